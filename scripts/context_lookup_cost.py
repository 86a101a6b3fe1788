#!/usr/bin/env python3
"""What the context drafter costs per token at a long context (issue 13: "well under 1% of
a target token at 32k tokens of context").

Fills a ContextSource (spec/suffix.py) with --context real token ids (the cached greedy
streams of scripts/fit_copy_model.py, prompts and outputs in turn, repeated as needed), then
emits the tokens of five code-edit outputs one at a time as spec decoding does with no draft
taken: plan() (proposal, the copy model's prediction, the cost-aware choice) and
extend(emitted=True) (the trie's first guess scored, the token added). Prints the median over
the outputs of the milliseconds per token with the shipped copy model and with the built-in guess.

    python scripts/context_lookup_cost.py --context 32768
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--target-sha", default="cc324af070c2ecbf",
                    help="first 16 hex digits of the target's sha256 (its streams and model)")
    ns = ap.parse_args()

    from specee_cpp.errors import SpeceeError
    from specee_cpp.paths import home
    from specee_cpp.records import records
    from specee_cpp.spec.copy_model import CopyModel, bundle_path
    from specee_cpp.spec.cost import CostModel
    from specee_cpp.spec.suffix import ContextSource

    path = home() / "copy-profile" / f"{ns.target_sha}.jsonl"
    streams = records(path, what="copy profile", missing_ok=True)
    if not streams:
        raise SpeceeError(f"no streams in {path}: run scripts/fit_copy_model.py first")
    fill: list[int] = []
    while len(fill) < ns.context:
        for s in streams:
            fill += s["prompt"] + s["output"]
    fill = fill[:ns.context]
    emits = [s["output"] for s in streams if s.get("category") == "code_edit"][:5]
    # costs that never let a draft pay: every round is a plain step, as it is for most
    # tokens; the proposal, prediction and choice are computed all the same
    costs = CostModel([1.0 + 2.0 * i for i in range(16)], 1.0)
    model = CopyModel.load(bundle_path(ns.target_sha))
    for name, m in (("copy model", model), ("built-in guess", None)):
        src = ContextSource(costs, model=m)
        t0 = time.perf_counter()
        src.extend(fill)
        t_fill = time.perf_counter() - t0
        per = []
        for emit in emits:   # one output after another, the context growing
            t0 = time.perf_counter()
            for tok in emit:
                src.plan(len(src.trie))
                src.extend([tok], emitted=True)
            per.append((time.perf_counter() - t0) / len(emit))
        print(f"{name}: {statistics.median(per) * 1e3:.3f} ms per emitted token (median of "
              f"{len(per)} outputs, {sum(map(len, emits))} tokens) at {len(fill)}+ tokens of "
              f"context; filling the trie took {t_fill:.1f} s, {len(src.trie.count)} nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What reading each drafted token in C (patch 0013) saves: plain, then `--mode spec --gamma
auto` with each draft token's confidence read the old way (a copy of the n_vocab logits and a
softmax over them in numpy) and the new way (`Context.confidence`, in C), in turn per prompt,
one process; each spec variant keeps its own guard (as a bench config does). Prints each
prompt's speed over plain for both, and per category the pooled ratios and new over old.
Greedy: all three must emit the same tokens (a prompt where they do not is marked).

    python scripts/draft_read_ab.py --prompts humaneval:0-11 --max-tokens 128
    python scripts/draft_read_ab.py --prompts 41,47,161,167 --repeats 2
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b:auto")
    ap.add_argument("--prompts", default="humaneval:0-11",
                    help="humaneval:LO-HI, or line numbers of the dev prompt file")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ns = ap.parse_args()

    import numpy as np

    from specee_cpp.bench import prompts as bp
    from specee_cpp.bench.suite import shorten
    from specee_cpp.engine.llm import load
    from specee_cpp.engine.sequence import Sequence
    from specee_cpp.spec import mode
    from specee_cpp.spec.decode import draft_confidence

    variant = {"now": "c"}
    in_c = Sequence.confidence

    def in_numpy(seq, i=-1):
        lg = seq.logits(i)
        top1, ent = draft_confidence(lg)
        return int(np.argmax(lg)), top1, ent

    Sequence.confidence = lambda seq, i=-1: (in_c if variant["now"] == "c" else in_numpy)(seq, i)
    policy = mode.draft_policy
    mode.draft_policy = lambda llm, opts, kind="spec": policy(llm, opts, (kind, variant["now"]))

    pooled = defaultdict(lambda: [0.0, 0.0, 0.0])   # plain, numpy, C seconds per category
    with load(ns.target, draft=ns.draft) as llm:
        if ns.prompts.startswith("humaneval"):
            todo = bp.load(ns.prompts)
        else:
            by_id = {p.id: p for p in bp.load_spec_bench(bp.DEV_PROMPTS)}
            todo = [shorten(by_id[f"{bp.DEV_PROMPTS.stem}:{i.strip()}"], llm.model,
                            ns.max_prompt_tokens) for i in ns.prompts.split(",")]
        for r in range(ns.repeats):
            for p in todo:
                runs = {}
                order = [("plain", "c"), ("numpy", "numpy"), ("c", "c")]
                if r % 2:
                    order = [order[0], order[2], order[1]]
                for name, read in order:
                    variant["now"] = read
                    llm.reset()
                    kw = {} if name == "plain" else {"mode": "spec", "gamma": "auto"}
                    t0, toks = time.perf_counter(), []
                    for s in llm.stream(p.text, max_tokens=ns.max_tokens, chat=p.chat,
                                        stop=p.stop, **kw):
                        if "prefill" in s.timings:   # the clock runs from the first token
                            t0, toks = time.perf_counter(), []
                            continue
                        toks.append(s.token)
                    runs[name] = (time.perf_counter() - t0, toks)
                # seconds a token (outputs equal: the same count; else per token all the same)
                per = {k: sec / max(len(toks), 1) for k, (sec, toks) in runs.items()}
                same = runs["numpy"][1] == runs["plain"][1] == runs["c"][1]
                a = pooled[p.category]
                for j, k in enumerate(("plain", "numpy", "c")):
                    a[j] += per[k] * len(runs["plain"][1])
                print(f"{p.id} ({p.category}, {len(runs['plain'][1])} tokens): numpy read "
                      f"{per['plain'] / per['numpy']:.3f}x plain, C read "
                      f"{per['plain'] / per['c']:.3f}x" + ("" if same else "  OUTPUT DIFFERS"),
                      flush=True)
        print(f"draft: {llm.draft_path.name}")
    print("| category | numpy read / plain | C read / plain | C over numpy |")
    print("|---|---|---|---|")
    for cat, (pl, npy, c) in pooled.items():
        print(f"| {cat} | {pl / npy:.3f} | {pl / c:.3f} | {npy / c:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

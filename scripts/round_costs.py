#!/usr/bin/env python3
"""Real speculative rounds against the cost table: where `--mode spec` loses time.

Runs `--mode spec --gamma auto` (greedy) on Spec-Bench dev prompts and groups its rounds by
source (the draft model, the context) and draft length: per group, the median verification
time over the median plain step of the same run, beside what this machine's cost table says
(`CostModel.verify(n + 1)` at that context), the draft's time, and the acceptance. A table
that matches reality while a group's acceptance stays low says the loss is in what was
drafted, not in what rounds cost. Each group also shows the draft's catch-up (the batch a
model round first reads when the draft is behind: plain steps, free drafts, a prompt left
unread while the guard held drafting back): its largest, in plain steps, and its share of
the group's time, which medians hide.

With ``--with-plain`` every prompt also runs plain decoding just before each spec run
(``--repeats`` times, the pair's guard kept between prompts as a chat or a bench keeps it)
and each prints its ms per token: an in-process A/B, per prompt, the same run.

    python scripts/round_costs.py --draft qwen2.5-coder-0.5b:Q4_0 \\
        --ids 161,174,187,2,28,122,54,67
    python scripts/round_costs.py --ids 95,81,54,187 --with-plain --repeats 2
"""
from __future__ import annotations

import argparse
import statistics as st
import sys
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b:auto")
    ap.add_argument("--ids", default="161,174,187,2,28,122,54,67",
                    help="line numbers of the dev prompt file (spec_bench_dev:N)")
    ap.add_argument("--prompts", default="",
                    help="a bench prompt source instead of --ids, e.g. humaneval:19-20")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="cut longer user messages in the middle as bench does (default: 256 "
                         "for --ids, as the Spec-Bench benches run; none for --prompts, whose "
                         "code edits copy from the whole prompt)")
    ap.add_argument("--with-plain", action="store_true",
                    help="run plain decoding before each spec run and print both speeds")
    ap.add_argument("--repeats", type=int, default=1)
    ns = ap.parse_args()

    from specee_cpp.bench.prompts import DEV_PROMPTS, load as load_prompts, load_spec_bench
    from specee_cpp.bench.suite import shorten
    from specee_cpp.config import MAX_VERIFY
    from specee_cpp.engine.llm import load
    from specee_cpp.spec.mode import SpecOptions, cost_model, draft_policy, verify_scale

    with load(ns.target, draft=ns.draft) as llm:
        if ns.prompts:
            chosen = load_prompts(ns.prompts)
        else:
            by_id = {p.id: p for p in load_spec_bench(DEV_PROMPTS)}
            chosen = [by_id[f"{DEV_PROMPTS.stem}:{i.strip()}"] for i in ns.ids.split(",")]
        cut = ns.max_prompt_tokens if ns.max_prompt_tokens is not None else (
            0 if ns.prompts else 256)
        plain, rounds, table = [], defaultdict(list), None
        total = defaultdict(lambda: [0.0, 0])   # mode -> seconds, tokens over all prompts
        for _ in range(ns.repeats):
            for p in chosen:
                p = shorten(p, llm.model, cut)
                speeds = {}
                for mode in ("plain", "spec") if ns.with_plain else ("spec",):
                    llm.reset()
                    t0, n = time.perf_counter(), 0
                    for s in llm.stream(p.text, max_tokens=ns.max_tokens, mode=mode, chat=p.chat,
                                        **({"gamma": "auto"} if mode == "spec" else {})):
                        if "prefill" in s.timings:   # the clock runs from the first token
                            t0, n = time.perf_counter(), 0
                            continue
                        n += 1
                        if mode == "plain" or not s.timings:   # an accepted drafted token
                            continue
                        if table is None:
                            table = cost_model(llm)   # the chosen draft's (NAME:auto picks first)
                        if not s.n_drafted:
                            plain.append(s.timings.get("decode", 0.0))
                            continue
                        c = table.at(len(llm.tgt.seq.tokens))
                        rounds[(s.source, s.n_drafted)].append(
                            (s.timings.get("verify", 0.0), c.verify(s.n_drafted + 1) / c.plain,
                             s.timings.get("draft", 0.0), s.n_accept,
                             s.timings.get("catch_up", 0.0), sum(s.timings.values())))
                    dt = time.perf_counter() - t0
                    speeds[mode] = dt / max(n, 1)
                    total[mode][0] += dt
                    total[mode][1] += n
                if ns.with_plain:
                    print(f"{p.id} ({p.category}): plain {speeds['plain'] * 1e3:.1f} ms a "
                          f"token, spec {speeds['spec'] * 1e3:.1f} "
                          f"({speeds['plain'] / speeds['spec']:.3f}x)", flush=True)
        # the pair's correction as the spec runs kept it (draft_policy returns the cached
        # one); read while the pair is open
        corr = draft_policy(llm, SpecOptions(gamma="auto")).correction
        scale = verify_scale(llm, cost_model(llm)) if table is not None else None
    if not plain or table is None:
        print("no plain steps to compare with", file=sys.stderr)
        return 1
    if ns.with_plain:
        (ps, pn), (ss, sn) = total["plain"], total["spec"]
        print(f"all prompts: plain {ps / pn * 1e3:.1f} ms a token, spec {ss / sn * 1e3:.1f} "
              f"({(ps / pn) / (ss / sn):.3f}x)")
    if corr is not None and corr.rounds:
        print(f"the round model's correction after these prompts: x{corr.factor:.3f} "
              f"(accepted {corr.observed:.1f} / predicted {corr.predicted:.1f}, decayed)")
    if scale is not None:
        print(f"verification as the context drafter learned it against the table: "
              f"x{scale.factor(2):.3f} up to {MAX_VERIFY} rows, "
              f"x{scale.factor(MAX_VERIFY + 1):.3f} past (cost.VerifyScale)")
    pm = st.median(plain)
    print(f"{len(plain)} plain steps, median {pm * 1e3:.1f} ms (table: "
          f"{table.points[0].plain * 1e3:.1f} ms at {table.points[0].context} tokens)")
    print("| source | drafted | rounds | verify / plain (real) | (table) | draft / plain | "
          "acceptance | largest catch-up / plain | catch-up share of time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (src, n), v in sorted(rounds.items()):
        print(f"| {src} | {n} | {len(v)} | {st.median(x[0] for x in v) / pm:.2f} | "
              f"{st.median(x[1] for x in v):.2f} | {st.median(x[2] for x in v) / pm:.2f} | "
              f"{sum(x[3] for x in v) / (len(v) * n):.2f} | {max(x[4] for x in v) / pm:.2f} | "
              f"{sum(x[4] for x in v) / max(sum(x[5] for x in v), 1e-9):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

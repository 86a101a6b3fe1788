#!/usr/bin/env python3
"""How much this machine's cost table moves from one measurement to the next.

Measures the speculative cost table of a pair (`spec/cost.measure`, the method `specee-cpp
costs` caches) several times in one process at one context, and prints each measurement's
costs in plain tokens (verify of n tokens, a draft token) and the spread of each column,
(max - min) / median. The policies read these ratios, so their spread is how far a cached
table can be from the machine as it is at another hour.

    python scripts/cost_spread.py [model] [--draft NAME] [--times 4] [--context 128]
"""
from __future__ import annotations

import argparse
import sys

SIZES = (2, 4, 8, 16, 32, 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--times", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="medians of this many (as cached)")
    ns = ap.parse_args()

    import numpy as np

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine
    from specee_cpp.spec import cost

    with LLM(ns.model, draft=ns.draft, config=LoadConfig()) as llm:
        tokens = llm.prompt_tokens("Write a Python function that parses a CSV file and "
                                   "returns its rows as dicts.")
        print(f"{describe(machine(llm.config.threads))}; measurement version "
              f"{cost.MEASURE_VERSION}; {ns.times} measurements at {ns.context} tokens")
        head = ["plain ms"] + [f"v({n})" for n in SIZES] + ["draft"]
        print(" | ".join(head))
        rows = []
        for _ in range(ns.times):
            m = cost.measure(llm.tgt.seq, llm.dft.seq, tokens, repeats=ns.repeats,
                             n_context=ns.context)
            v = m.verify_curve(max(SIZES))
            rows.append([v[n - 1] / m.plain for n in SIZES] + [m.draft_token_s / m.plain])
            print(" | ".join([f"{m.plain * 1000:.1f}"] + [f"{x:.2f}" for x in rows[-1]]),
                  flush=True)
    a = np.array(rows)
    spread = (a.max(0) - a.min(0)) / np.median(a, 0)
    print(" | ".join(["spread"] + [f"{x:.1%}" for x in spread]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

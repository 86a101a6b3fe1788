#!/usr/bin/env python3
"""Patch 0015's weight prefetch on and off, in one process: ms per decode and the ratio.

Loads each model once, fills a --context-token cache, then times batches of every size in
--sizes (1: a plain decoding step; 2-16: verifications) with each prefetch distance of
--distances in turn, step after step (the first distance is the reference, 0 is off), and
prints per size the median time and the median of the per-step ratios to the reference.
Switching the setting between steps of the same process is what makes the ratio trustworthy
on a shared 2-core VM, whose speed drifts by 10-20% between processes
(docs/AMX.md, "x86: weights asked for ahead").

    python scripts/prefetch_ab.py [MODEL ...] [--distances 0,4608] [--sizes 1,2,4,8,16]
        [--repeats 30] [--context 128]
"""
from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["qwen2.5-coder-1.5b"])
    ap.add_argument("--distances", default="0,4608", help="bytes ahead; the first is the "
                                                          "reference, 0 is off")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--context", type=int, default=128)
    ns = ap.parse_args()
    try:
        distances = [int(x) for x in ns.distances.split(",")]
        sizes = [int(x) for x in ns.sizes.split(",")]
    except ValueError:
        print(f"--distances and --sizes take comma-separated integers; got "
              f"{ns.distances!r}, {ns.sizes!r}", file=sys.stderr)
        return 2

    import numpy as np

    from specee_cpp.bindings import cpu_prefetch_bytes, set_cpu_prefetch_bytes
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.errors import SpeceeError
    from specee_cpp.provenance import describe, machine

    for name in ns.models:
        with LLM(name, config=LoadConfig()) as llm:
            shipped = cpu_prefetch_bytes()
            if shipped is None:
                print("this build has no weight prefetch setting (patch 0015)", file=sys.stderr)
                return 1
            seq = llm.tgt.seq
            text = "Write a Python function that parses a CSV file and returns its rows as dicts. "
            toks = llm.prompt_tokens(text * 8, chat=False)
            toks = (toks * (max(sizes + [ns.context]) // len(toks) + 1))
            seq.prefill(toks[:ns.context], read=False)

            def timed(n: int) -> float:
                return seq.timed_greedy(toks[:n])

            try:
                for n in sizes:   # warm-up: every graph shape, every setting
                    for d in distances:
                        set_cpu_prefetch_bytes(d)
                        timed(n)
                res = {(d, n): [] for d in distances for n in sizes}
                for _ in range(ns.repeats):
                    for n in sizes:
                        for d in distances:
                            set_cpu_prefetch_bytes(d)
                            res[(d, n)].append(timed(n))
            except SpeceeError as e:
                print(e, file=sys.stderr)
                return 1
            finally:
                set_cpu_prefetch_bytes(shipped)
            print(f"{llm.tgt.model.path.name}: {describe(machine(llm.config.threads))}; "
                  f"{ns.context}-token context; shipped distance {shipped}; medians of "
                  f"{ns.repeats}, settings alternating step by step")
            print("| rows | " + " | ".join(f"{d} B: ms (ratio)" for d in distances) + " |")
            print("|---|" + "---|" * len(distances))
            for n in sizes:
                ref = np.array(res[(distances[0], n)])
                print(f"| {n} | " + " | ".join(
                    f"{np.median(res[(d, n)]) * 1000:.1f} ({np.median(np.array(res[(d, n)]) / ref):.3f})"
                    for d in distances) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

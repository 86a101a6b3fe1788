#!/usr/bin/env python3
"""The target's verification cost at every batch size, in plain tokens of the same run.

Times a greedy verification batch of n tokens (every output row's argmax read in C) after
a --context-token cache for every n in --sizes, each sample against a plain token timed
just before it (as `spec/cost.measure` does), and prints the median ratio per size. The
cost table measures 1..16 and 24/32/48/64 and interpolates between: this shows what lies
between (on x86, llama.cpp's repacked Q4_K gemm runs 16-row groups with AVX-512 and the
rest in 4-row groups, so multiples of 16 are local minima). llama.cpp's own switches apply:
`GGML_CPU_TILED_MM=0 python scripts/verify_curve.py` turns off its tiled K-quant matmul,
which it takes from 8 rows; `GGML_REPACK_FUSED_ROWS=0` (patch 0011, x86 without AMX) restores
upstream's 4-row gemm and one-row gemv for repacked Q4_K, `GGML_Q6_K_FUSED_ROWS=0` (patch 0012)
its dot per row pair (and tiled matmul from 8 rows) for Q6_K.

    python scripts/verify_curve.py [model] [--sizes 1-64 | 8,12,16-20] [--repeats 5] [--context 128]
"""
from __future__ import annotations

import argparse
import os
import sys


def sizes(spec: str) -> list[int]:
    """'1-16', '8,12,16-20,32' -> the batch sizes, in order."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--sizes", default="1-64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ns = ap.parse_args()

    import numpy as np

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine

    todo = sizes(ns.sizes)
    with LLM(ns.model, config=LoadConfig()) as llm:
        seq = llm.tgt.seq
        text = "Write a Python function that parses a CSV file and returns its rows as dicts. "
        toks = llm.prompt_tokens(text * 8, chat=False)
        filler = (toks * (max(todo) // len(toks) + 1))[:max(todo)]
        seq.prefill((toks * (ns.context // len(toks) + 1))[:ns.context], read=False)

        def timed(n: int) -> float:
            return seq.timed_greedy(filler[:n])

        for n in todo:   # warm-up: every graph shape once
            timed(n)
        ratios: dict[int, list[float]] = {n: [] for n in todo}
        plain: list[float] = []
        for _ in range(ns.repeats):
            for n in todo:
                ref = timed(1)
                plain.append(ref)
                ratios[n].append(timed(n) / ref)
        print(f"{describe(machine(llm.config.threads))}; GGML_CPU_TILED_MM="
              f"{os.environ.get('GGML_CPU_TILED_MM', 'unset')}; {ns.context}-token context; "
              f"plain token {np.median(plain) * 1000:.1f} ms; medians of {ns.repeats}")
    print("n | verify(n) in plain tokens")
    for n in todo:
        print(f"{n} | {np.median(ratios[n]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What one shared CPU thread pool saves: decodes with the pool attached to both contexts
against each decode making its own (llama.cpp's default without llama_attach_threadpool).

Times, A/B interleaved in one process (pool attached, then detached, per repeat), after a
128-token context: a target token, a draft token, and a speculative round as spec runs it
(3 draft decodes, then a 4-token verification). Under OpenMP the per-decode pool is only an
allocation, so expect ~1.00; a build without OpenMP (macOS clang, GGML_OPENMP=OFF) starts
n_threads - 1 threads per decode without a pool. Appends its table to docs/BENCHMARKS.md.

    python scripts/threadpool_check.py [--repeats 15] [--no-write]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    ns = ap.parse_args()

    import os

    os.environ["SPECEE_CPP_THREADPOOL"] = "1"       # the shared pool is opt-in
    from specee_cpp.bench.report import write_section
    from specee_cpp.bindings import _ffi
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine

    cfg = LoadConfig()
    with LLM(ns.target, draft=ns.draft, config=cfg) as llm:
        tgt, dft = llm.tgt.seq, llm.dft.seq
        pool = llm.tgt.ctx.threadpool
        if not pool:
            print("no shared pool in this build (see bindings.llama.shared_threadpool)")
            return 1
        ctx = (llm.prompt_tokens("Write a function that parses a date and explain it.") * 16)[:128]
        tgt.prefill(ctx)
        dft.prefill(ctx)
        n0 = len(ctx)
        fill = ctx[:8]

        def attach(on: bool) -> None:
            for c in (llm.tgt.ctx, llm.dft.ctx):
                if on:
                    _ffi.llama_attach_threadpool(c.ptr, pool, pool)
                else:
                    _ffi.llama_detach_threadpool(c.ptr)

        def target_token():
            tgt.decode([fill[0]])
            tgt.argmax()

        def draft_token():
            dft.decode([fill[0]])
            dft.argmax()

        def spec_round():
            for t in fill[:3]:
                dft.decode([t])
                dft.argmax()
            tgt.decode_greedy(fill[:4])

        tasks = {"target token": target_token, "draft token": draft_token,
                 "spec round (3 drafts + verify 4)": spec_round}
        times = {(name, on): [] for name in tasks for on in (True, False)}
        for r in range(ns.repeats + 1):
            for on in (True, False):
                attach(on)
                for name, fn in tasks.items():
                    t0 = time.perf_counter()
                    for _ in range(4):
                        fn()
                        tgt.rewind(n0)
                        dft.rewind(n0)
                    if r:                   # the first repeat warms up
                        times[(name, on)].append((time.perf_counter() - t0) / 4)
        attach(True)
    where = describe(machine(cfg.threads))
    rows = []
    for name in tasks:
        a = statistics.median(times[(name, True)])
        b = statistics.median(times[(name, False)])
        rows.append(f"| {name} | {1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.3f} |")
    table = "\n".join(["| work | shared pool ms | a pool per decode ms | per-decode / shared |",
                       "|---|---|---|---|", *rows])
    print(table)
    if not ns.no_write:
        cmd = "python scripts/threadpool_check.py " + " ".join(sys.argv[1:])
        write_section(REPO / "docs" / "BENCHMARKS.md",
                      "One CPU thread pool for both contexts ("
                      + ("OpenMP build)" if "OPENMP" in where else "build without OpenMP)"),
                      f"`{cmd}`: medians of {ns.repeats} repeats, A/B interleaved in one process "
                      f"after a 128-token context, {ns.target} with draft {ns.draft}; measured "
                      f"on {where}; {time.strftime('%Y-%m-%d')}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where our plain decoding's time goes, beside llama.cpp's loop: three checks in one process.

1. The loop: a plain greedy stream's wall clock against the decode time its steps report;
   what is left is ours (Python, the argmax in C, detokenizing).
2. The context size: the same prompts decoded with n_ctx 512 (about what the bench gives
   llama.cpp's tools: prompt + limit + 64) and with ours (config.N_CTX), both loaded in
   this process and alternated prompt by prompt, order swapped every repeat.
3. Huge pages: how much of this process's memory is on transparent huge pages with the
   target (and draft) loaded as `bench` loads them.

    python scripts/plain_loop_check.py [--prompts 6] [--repeats 2] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import sys
import time


def stream_plain(llm, text: str, max_tokens: int) -> tuple[int, float, float]:
    """(tokens after the first, wall seconds, seconds inside the steps' decodes)."""
    llm.reset()
    t0, n, dec = None, 0, 0.0
    for s in llm.stream(text, max_tokens=max_tokens, mode="plain"):
        if "prefill" in s.timings:   # the clock runs from the first token
            t0 = time.perf_counter()
            continue
        n += 1
        dec += s.timings.get("decode", 0.0)
    return n, time.perf_counter() - t0, dec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b:auto")
    ap.add_argument("--prompts", type=int, default=6, help="dev prompts, spread over the file")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ns = ap.parse_args()

    from specee_cpp import memory
    from specee_cpp.bench.prompts import DEV_PROMPTS, load_spec_bench
    from specee_cpp.config import N_CTX, LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine

    pool = load_spec_bench(DEV_PROMPTS)
    prompts = [p.text[:600] for p in pool[::max(len(pool) // ns.prompts, 1)][:ns.prompts]]
    print(describe(machine(LoadConfig().threads)))
    ctxs = (N_CTX, 512)
    llms = {n: LLM(ns.target, config=LoadConfig(n_ctx=n)) for n in ctxs}
    try:
        loop = [0, 0.0, 0.0]
        per_ctx = {n: [0, 0.0] for n in ctxs}
        for rep in range(ns.repeats):
            for text in prompts:
                for n_ctx in (ctxs if rep % 2 == 0 else ctxs[::-1]):
                    n, wall, dec = stream_plain(llms[n_ctx], text, ns.max_tokens)
                    per_ctx[n_ctx][0] += n
                    per_ctx[n_ctx][1] += wall
                    if n_ctx == N_CTX:
                        loop = [loop[0] + n, loop[1] + wall, loop[2] + dec]
        n, wall, dec = loop
        print(f"1. loop: {wall / n * 1e3:.2f} ms a token, {(wall - dec) / n * 1e3:.3f} ms of it "
              f"outside the decodes ({(wall - dec) / wall:.2%})")
        ms = {c: t / k * 1e3 for c, (k, t) in per_ctx.items()}
        print(f"2. context: n_ctx {N_CTX} {ms[N_CTX]:.2f} ms a token, n_ctx 512 {ms[512]:.2f}: "
              f"512 runs {ms[N_CTX] / ms[512]:.3f}x as fast")
    finally:
        for llm in llms.values():
            llm.close()
    with LLM(ns.target, draft=ns.draft, config=LoadConfig()) as llm:
        llm.generate("Hello", max_tokens=2)
        huge = memory.anon_huge_bytes()
        print(f"3. huge pages: {memory.describe()}; with target and draft loaded "
              + (f"{huge / 2**20:.0f} MiB of this process on them" if huge is not None
                 else "the kernel does not say"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

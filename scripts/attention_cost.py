#!/usr/bin/env python3
"""One decoded token's time with llama.cpp's CPU flash attention on (its default) and off,
at several context lengths, for each model given (e.g. the target and the draft).

Each context is filled with a prompt in batches, then --tokens single-token decodes are timed
(the first --warmup dropped); medians in ms, both settings in the same process, one after
the other. On the 2-core AMX Xeon of session 19 (the command below) the 0.5B draft (Q4_0, 32k
head) took 11.54 ms with flash attention and 10.31 ms without at 128 tokens of context, 27.28
and 13.44 ms at 1024, while the 1.5B target took 59.87/66.50 and 66.78/67.56 ms: the draft's
long-context cost in the cost table (0.19 of a target token at 128, 0.41 at 1024) is mostly
its flash attention (docs/BENCHMARKS.md, "The draft's flash attention at long context").

    python scripts/attention_cost.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b:Q4_0:v32k \\
        [--contexts 128,1024] [--tokens 24] [--warmup 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()

    import numpy as np

    from specee_cpp.bindings import Batch, Context, Model
    from specee_cpp.engine.llm import resolve
    from specee_cpp.provenance import describe, machine

    contexts = [int(c) for c in ns.contexts.split(",")]
    n_ctx = max(contexts) + ns.tokens + 16
    print(describe(machine(ns.threads)))
    print("model | flash attention | " + " | ".join(f"{c} ctx ms" for c in contexts))
    for name in ns.models:
        model = Model(resolve(name))
        for fa in (True, False):
            row = []
            for c in contexts:
                ctx = Context(model, n_ctx=n_ctx, n_batch=512, n_threads=ns.threads,
                              flash_attn=fa)
                b = Batch(512)
                toks = [(1000 + 7 * i) % 30000 + 100 for i in range(c)]
                for s in range(0, c, 512):
                    b.set(toks[s:s + 512], s)
                    ctx.decode(b)
                times = []
                for i in range(ns.tokens):
                    b.set([500 + i], c + i)
                    t = time.perf_counter()
                    ctx.decode(b)
                    times.append(time.perf_counter() - t)
                row.append(1000 * float(np.median(times[ns.warmup:])))
                ctx.close()
            print(f"{name} | {'on' if fa else 'off'} | " + " | ".join(f"{v:.2f}" for v in row))
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

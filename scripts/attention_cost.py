#!/usr/bin/env python3
"""One decoded token's time with llama.cpp's CPU flash attention on (its default) and off,
at several context lengths, for each model given (e.g. the target and the draft).

Each context is filled with a prompt in batches, then --tokens single-token decodes are timed
(the first --warmup dropped); medians in ms, both settings in the same process, token by
token in turn (engine/attention.py ``time_attention``, with which the draft's setting is
chosen; before session 20 this script timed one setting after the other). On the 2-core
AMX Xeon of session 19 (the command below) the 0.5B draft (Q4_0, 32k head) took 11.54 ms with flash attention and 10.31 ms without at 128 tokens of context, 27.28
and 13.44 ms at 1024, while the 1.5B target took 59.87/66.50 and 66.78/67.56 ms: the draft's
long-context cost in the cost table (0.19 of a target token at 128, 0.41 at 1024) is mostly
its flash attention (docs/BENCHMARKS.md, "The draft's flash attention at long context").

    python scripts/attention_cost.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b:Q4_0:v32k \\
        [--contexts 128,1024] [--tokens 24] [--warmup 4] [--threads 2]
"""
from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()

    from specee_cpp.bindings import Model
    from specee_cpp.engine.attention import time_attention
    from specee_cpp.engine.llm import resolve
    from specee_cpp.provenance import describe, machine

    contexts = [int(c) for c in ns.contexts.split(",")]
    tokens = [(1000 + 7 * i) % 30000 + 100 for i in range(max(contexts))]
    print(describe(machine(ns.threads)))
    print("model | flash attention | " + " | ".join(f"{c} ctx ms" for c in contexts))
    for name in ns.models:
        model = Model(resolve(name))
        seen = time_attention(model, ns.threads, tokens, contexts, decodes=ns.tokens - ns.warmup,
                              warmup=ns.warmup)
        for setting in ("default", "off"):
            print(f"{name} | {setting} | " + " | ".join(f"{1e3 * v:.2f}" for v in seen[setting]))
        model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

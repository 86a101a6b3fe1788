"""What a staged decode (early exit's layer-by-layer path) costs over ``llama_decode`` on
this machine, by number of segments, with no probe taken: the overhead every early-exit
token pays before any exit saves anything.

    python scripts/staged_overhead.py                       # the default target
    python scripts/staged_overhead.py --model smollm2-135m --repeats 30

One token after 128 cached ones, decoded in turn by ``llama_decode`` (its greedy token read
in C, as plain decoding does) and staged in 1, 2, 4, 8 and 14 segments (boundaries spread
over the upper half of the layers, where exits are probed; logits read as early exit reads
them); each kind's median after a warm-up round, as a ratio to llama_decode's, in one run.
"""
from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default pair's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    import numpy as np

    from specee_cpp.config import COST_PROMPT, LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.engine.timing import time_calls
    from specee_cpp.models.registry import load_registry

    model = args.model or load_registry().pair("default")[0].name
    with LLM(model, config=LoadConfig(n_threads=args.threads)) as llm:
        seq, ctx = llm.tgt.seq, llm.tgt.ctx
        n_layer = llm.model.n_layer
        tokens = llm.prompt_tokens(COST_PROMPT)
        context = (tokens * (128 // len(tokens) + 1))[:128]
        seq.prefill(context, read=False)
        base = len(seq.tokens)

        def plain():
            seq.decode([context[0]])
            seq.argmax()

        def staged(n_seg: int):
            lo = n_layer // 2
            cuts = sorted({lo + (n_layer - lo) * i // n_seg for i in range(1, n_seg)})

            def run():
                seq.begin_staged([context[0]])
                for layer in cuts:
                    ctx.stage_run(layer)
                ctx.stage_run(n_layer)
                int(np.argmax(ctx.logits(-1)))
            return run

        kinds = {"llama_decode": plain, **{f"staged, {n} segment{'s' * (n > 1)}": staged(n)
                                           for n in (1, 2, 4, 8, 14) if n < n_layer // 2}}
        med = time_calls({name: (run, lambda: seq.rewind(base)) for name, run in kinds.items()},
                         args.repeats)
        ref = med["llama_decode"]
        print(f"{llm.model.path.name}, {n_layer} layers, one token after 128 cached, "
              f"{args.repeats} rounds (medians)")
        for name, m in med.items():
            print(f"  {name:<22} {1e3 * m:7.2f} ms  {m / ref:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

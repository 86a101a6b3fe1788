#!/usr/bin/env python3
"""Cross-validated replay of the context drafter's long-copy rule on the dev streams.

The streams are the target's plain greedy outputs that `scripts/fit_copy_model.py` cached
under $SPECEE_CPP_HOME/copy-profile (run it first). Five folds by stream: each stream is
replayed (spec/copy_model.simulate: its rounds exactly, its time from this machine's cost
table) by a copy model fitted without its fold. One line per setting of the rule
(ContextSource.FOLLOW_MIN / FOLLOW_HITS): speed-up over plain decoding per category and over
all streams. `--settings off` replays without the rule. No round drafts past the run's
max_tokens, as in `generate_spec`.

    python scripts/replay_copy_rules.py [--settings 16:0.8,off,12:0.7]
"""
from __future__ import annotations

import argparse
import sys

FOLDS = 5


def main() -> int:
    from fit_copy_model import add_data_args, prompts, stream_cache, streams as dev_streams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(ap)   # as fit_copy_model.py was run
    ap.add_argument("--settings", default="off,16:0.8",
                    help="comma-separated MIN:HITS, or off (no long-copy rule)")
    ns = ap.parse_args()

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine
    from specee_cpp.spec import copy_model as cm
    from specee_cpp.spec.mode import cost_model
    from specee_cpp.spec.suffix import ContextSource

    with LLM(ns.target, draft=ns.draft, config=LoadConfig()) as llm:
        table = cost_model(llm)
        cache = stream_cache(llm)
        where = describe(machine(llm.config.threads))
        if not cache.is_file():
            print(f"no dev streams at {cache}: run scripts/fit_copy_model.py first",
                  file=sys.stderr)
            return 1
        # the cached streams (with each run's max_tokens); any missing one is decoded now
        streams = dev_streams(llm, prompts(ns.edit_step), cache,
                              lambda msg: print(msg, file=sys.stderr))
        eog = llm.model.eog_tokens
    models = [cm.fit([s for i, s in enumerate(streams) if i % FOLDS != f]) for f in range(FOLDS)]
    print(f"{len(streams)} dev streams, {FOLDS}-fold; {where}; cost table {table.key}")
    default = (ContextSource.FOLLOW_MIN, ContextSource.FOLLOW_HITS)
    try:
        for spec in ns.settings.split(","):
            if spec == "off":
                ContextSource.FOLLOW_MIN = 10**9
            else:
                m, h = spec.split(":")
                ContextSource.FOLLOW_MIN, ContextSource.FOLLOW_HITS = int(m), float(h)
            per: dict[str, list[float]] = {}
            for i, s in enumerate(streams):
                r = cm.simulate(s["prompt"], s["output"], table, models[i % FOLDS],
                                limit=s["max_tokens"], is_eog=eog.__contains__)
                row = per.setdefault(s["category"], [0.0, 0.0])
                row[0] += r.seconds
                row[1] += r.plain_seconds
            total = sum(v[1] for v in per.values()) / sum(v[0] for v in per.values())
            print(f"{spec:>12}: " + ", ".join(f"{c} {v[1] / v[0]:.3f}"
                                              for c, v in sorted(per.items()))
                  + f"; all {total:.3f}")
            ContextSource.FOLLOW_MIN, ContextSource.FOLLOW_HITS = default
    finally:
        ContextSource.FOLLOW_MIN, ContextSource.FOLLOW_HITS = default
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Replay the shipped copy model on held-out streams: the context drafter's speed-up over
plain decoding per category, with this machine's cost table, against the built-in guess and
an oracle (spec/copy_model.simulate; exact rounds, time from the costs).

The held-out streams are the target's plain greedy outputs on prompts that nothing was
fitted on, decoded once and cached under $SPECEE_CPP_HOME/copy-profile (heldout-*.jsonl;
an interrupted run resumes):
  - code edits of HumanEval tasks 82-163 (`humaneval-edit`, 192 tokens; the dev tasks are
    0-81);
  - Spec-Bench dev first turns outside the 64-prompt fitting pool, --per-category a
    category, cut to 256 tokens as bench cuts them (64 tokens);
  - MT-Bench second turns of records outside the pool, in their conversation with the
    target's own plain turn-1 answer (bench's multi-turn path; 64 tokens).
Many more prompts than a timed bench can afford on two cores (82 code edits against 8), and
one set of outputs for every model compared: a change to the copy model or the drafter is
read here first, then confirmed by `specee-cpp bench`. Never fit or tune on these.

    python scripts/replay_held_out.py [--per-category 8] [--turn2 12] [--edits 82-163]
"""
from __future__ import annotations

import argparse
import sys


HELD_OUT_EDITS = 82   # HumanEval tasks 0-81 are dev (fitting, tuning), 82-163 held out


def held_out_prompts(per_category: int, turn2: int, edits: str = "82-163"):
    """(prompt, max_tokens) pairs of the held-out streams, in a fixed order."""
    from specee_cpp.bench.prompts import (DEV_PROMPTS, fitting_pool, load_humaneval_edit,
                                          load_spec_bench, per_category as by_category,
                                          with_turns)

    every = load_spec_bench(DEV_PROMPTS)
    pool = {p.id for p in fitting_pool(every, 64)}
    first = by_category(every, per_category, pool)
    outside = [p for p in every if p.id not in pool and p.category == "mt_bench"]
    second = [p for p in with_turns(outside, 2) if p.earlier][:turn2]
    code = load_humaneval_edit(edits) if edits else []
    # a range is loaded in task order: its first task is its lowest
    if code and int(code[0].task["task_id"].split("/")[1]) < HELD_OUT_EDITS:
        raise SystemExit(f"--edits {edits} reaches dev tasks ({code[0].task['task_id']}): "
                         f"the held-out code edits are tasks {HELD_OUT_EDITS}-163")
    return [(p, 192) for p in code] + [(p, 64) for p in first] + [(p, 64) for p in second]


def main() -> int:
    from fit_copy_model import add_model_args, stream_cache, streams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--per-category", type=int, default=8,
                    help="Spec-Bench first turns per category")
    ap.add_argument("--turn2", type=int, default=12, help="MT-Bench second turns")
    ap.add_argument("--edits", default="82-163",
                    help="held-out code edits LO-HI (within 82-163; empty: none): all 82 "
                         "take ~20 min to decode on two cores the first time")
    ns = ap.parse_args()

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine
    from specee_cpp.spec import copy_model as cm
    from specee_cpp.spec.mode import cost_model

    with LLM(ns.target, draft=ns.draft, config=LoadConfig(n_ctx=4096)) as llm:
        sha = llm.model.sha256
        cache = stream_cache(llm, "heldout-")
        cache.parent.mkdir(parents=True, exist_ok=True)
        data = streams(llm, held_out_prompts(ns.per_category, ns.turn2, ns.edits), cache,
                       lambda msg: print(f"[held-out] {msg}", file=sys.stderr, flush=True))
        table = cost_model(llm)
        where = describe(machine(llm.config.threads))
        eog = llm.model.eog_tokens
    model = cm.CopyModel.load(cm.bundle_path(sha))
    print(f"{len(data)} held-out streams; {where}; cost table {table.key}; copy model "
          f"version {model.meta.get('version')} ({cm.bundle_path(sha).name})")
    rows = cm.replay(data, model, table, eog.__contains__, total="all")
    print(f"{'category':18} {'streams':>7} {'fitted':>7} {'guess':>7} {'oracle':>7} "
          f"{'drafted':>8} {'accepted':>8}")
    for cat in sorted(rows, key=lambda c: (c == "all", c)):
        r = rows[cat]
        print(f"{cat:18} {r['streams']:7d} {r['speedup_fitted']:7.3f} {r['speedup_guess']:7.3f} "
              f"{r['speedup_oracle']:7.3f} {r['drafted_fitted']:8d} {r['accepted_fitted']:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Replay the context drafter over a bench run's plain outputs: per category, the speed-up
over plain decoding this machine's cost table predicts for the free drafts, with drafted
and accepted counts (spec/copy_model.replay: exact rounds, time from the costs).

A bench's `plain` rows are the target's greedy answers; re-tokenized with their prompts
(Spec-Bench prompts cut to --max-prompt-tokens as bench cuts them, others from --prompts)
they replay what `--mode spec` would draft from the context on them, for no decoding at
all: a change to the drafter is read here first, on the very answers whose timed run it
is meant to change, then confirmed by `specee-cpp bench`. `--set NAME=V1,V2` replays the
drafter with one of its settings (a numeric class attribute of `spec.suffix.ContextSource`:
COPY_PRIOR, FOLLOW_MIN, FOLLOW_HITS, ...) changed, one column per value beside the shipped
settings, with the geometric mean over the categories below (repeat the option for more
settings, each varied alone); `--copy-prior A,B` is `--set COPY_PRIOR=A,B` (`off`: no
per-answer correction of the copy model).
`--real-scale` times the rounds with the table's batches scaled (the drafter still decides
with the table): where real verification runs dearer than the table
(`scripts/round_costs.py` prints by how much), the replay reads what a bench will, not what
the table promises (the 2-core EPYC's code edits: 1.62x by the table, 1.41x with x1.18 up
to 16 rows and x1.22 past, 1.46x in their bench). `--as-run` gives the drafter what
`--mode spec` gives it: a guard of its short drafts per answer and a verification scale
learned from the (timed) rounds over the answers in order.

    python scripts/replay_bench.py docs/bench/humaneval-0-23-epyc-avx2-s31.jsonl \\
        --prompts humaneval:0-23 --max-tokens 128 --copy-prior off,6
    python scripts/replay_bench.py docs/bench/code-edit-epyc-avx2-s32.jsonl \\
        --prompts humaneval-edit:82-89 --max-tokens 192 --real-scale 1.18,1.22
    python scripts/replay_bench.py docs/bench/rag-summ-8-epyc-avx2-s32.jsonl --as-run \
        --real-scale 1.18,1.22 --set FOLLOW_MIN=8,24 --set FOLLOW_HITS=0.7
"""
from __future__ import annotations

import argparse
import json
import math
import sys

OFF = 1e12   # COPY_PRIOR 'off': a prior no answer outweighs, the correction stays 1


def variants(sets: list[str], source_cls) -> list[tuple[str, object]]:
    """(attribute, value) of every variant ``--set NAME=V1,V2`` asks for, each value of the
    attribute's own type ('off' for COPY_PRIOR: a prior no answer outweighs); raises
    ValueError, naming the offending setting, for anything else."""
    out = []
    for item in sets:
        name, eq, values = item.partition("=")
        name = name.strip().upper()
        current = getattr(source_cls, name, None) if name.isidentifier() else None
        if not eq or not isinstance(current, (int, float)) or isinstance(current, bool):
            known = sorted(k for k, v in vars(source_cls).items() if k.isupper()
                           and isinstance(v, (int, float)) and not isinstance(v, bool))
            raise ValueError(f"--set wants NAME=V1[,V2...] with NAME one of "
                             f"{', '.join(known)}; got {item!r}")
        for v in (x.strip() for x in values.split(",") if x.strip()):
            if name == "COPY_PRIOR" and v == "off":
                out.append((name, OFF))
                continue
            try:
                x = float(v)
            except ValueError:
                raise ValueError(f"--set {name}: {v!r} is not a number") from None
            if isinstance(current, int):
                if not x.is_integer():
                    raise ValueError(f"--set {name} takes whole numbers; got {v!r}")
                x = int(x)
            out.append((name, x))
    return out


def label(name: str, value: object) -> str:
    return f"{name} off" if name == "COPY_PRIOR" and value == OFF else f"{name} {value:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", help="bench rows (docs/bench/NAME.jsonl)")
    ap.add_argument("--prompts", default="", help="their prompt source where not Spec-Bench "
                                                  "dev (e.g. humaneval:0-23)")
    ap.add_argument("--max-tokens", type=int, default=64, help="the run's limit")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                    help="replay with a setting of the context drafter changed "
                         "(ContextSource.NAME), one column per value; repeatable")
    ap.add_argument("--copy-prior", default="",
                    help="comma-separated priors of the per-answer copy correction to "
                         "compare ('off': none): --set COPY_PRIOR=...")
    ap.add_argument("--real-scale", default="",
                    help="SHORT[,LONG]: time the rounds with the table's batches of up to 16 "
                         "rows (and longer ones) multiplied by these; default: the table")
    ap.add_argument("--as-run", action="store_true",
                    help="the drafter with its guard and learned verification scale, as "
                         "--mode spec runs it")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b:auto", help="keys the cost table")
    ns = ap.parse_args()

    from specee_cpp.bench.prompts import DEV_PROMPTS, load as load_prompts, load_spec_bench
    from specee_cpp.bench.suite import shorten
    from specee_cpp.engine.llm import load
    from specee_cpp.spec.copy_model import replay
    from specee_cpp.spec.mode import copy_model, cost_model
    from specee_cpp.spec.suffix import ContextSource

    try:
        scale = [float(x) for x in ns.real_scale.split(",") if x.strip()]
    except ValueError:
        scale = []
    if ns.real_scale and (not 1 <= len(scale) <= 2 or any(x <= 0 for x in scale)):
        print(f"--real-scale wants SHORT[,LONG], positive numbers; got {ns.real_scale!r}",
              file=sys.stderr)
        return 2
    try:
        changed = variants(ns.set + ([f"COPY_PRIOR={ns.copy_prior}"] if ns.copy_prior else []),
                           ContextSource)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    rows = [json.loads(line) for f in ns.jsonl for line in open(f, encoding="utf-8")]
    rows = [r for r in rows if r.get("config") == "plain" and r.get("text") is not None]
    with load(ns.target, draft=ns.draft) as llm:
        table, model, eog = cost_model(llm), copy_model(llm), llm.model.is_eog
        prompts = {p.id: shorten(p, llm.model, ns.max_prompt_tokens)
                   for p in load_spec_bench(DEV_PROMPTS)}
        if ns.prompts:
            prompts.update({p.id: p for p in load_prompts(ns.prompts)})
        streams = []
        for r in rows:
            p = prompts.get(r["prompt_id"])
            if p is None:
                print(f"{r['prompt_id']}: not in the prompt sources; pass --prompts",
                      file=sys.stderr)
                return 1
            streams.append({"category": r["category"], "max_tokens": ns.max_tokens,
                            "prompt": llm.prompt_tokens(p.text, chat=p.chat),
                            "output": llm.model.tokenize(r["text"], add_special=False)})
        timing = table.scaled(*scale) if scale else None
        print(f"{len(streams)} plain answers of {', '.join(ns.jsonl)}; cost table of "
              f"{table.machine.get('cpu', '?')} ({table.machine.get('build', '?')})"
              + (f"; rounds timed with its batches x{scale[0]:g} up to 16 rows, "
                 f"x{scale[-1]:g} past" if scale else "")
              + ("; the drafter as --mode spec runs it (guard, learned scale)"
                 if ns.as_run else ""))
        heads = ["shipped"] + [label(n, v) for n, v in changed]
        print("| category | answers | " + " | ".join(f"{h}: speed-up (drafted/accepted)"
                                                     for h in heads) + " |")
        print("|---|---|" + "---|" * len(heads))
        runs = [replay(streams, model, table, eog, timing=timing, as_run=ns.as_run)]
        for name, value in changed:
            shipped = getattr(ContextSource, name)
            setattr(ContextSource, name, value)
            try:
                runs.append(replay(streams, model, table, eog, timing=timing,
                                   as_run=ns.as_run))
            finally:
                setattr(ContextSource, name, shipped)
        for cat in sorted(runs[0]):
            print(f"| {cat} | {runs[0][cat]['streams']} | " + " | ".join(
                f"{r[cat]['speedup_fitted']:.3f} ({r[cat]['drafted_fitted']}/"
                f"{r[cat]['accepted_fitted']})" for r in runs) + " |")
        if len(runs[0]) > 1:
            print(f"| geometric mean | {len(streams)} | " + " | ".join(
                f"{math.exp(sum(math.log(c['speedup_fitted']) for c in r.values()) / len(r)):.4f}"
                for r in runs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

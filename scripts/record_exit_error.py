#!/usr/bin/env python3
"""Record in the shipped exit-predictor bundles how often their exits were wrong end to end.

For each early-exit configuration at a quality target (bench configurations of mode ee with
no forced threshold) in the given `specee-cpp bench` summaries, the exits' token error is
estimated as the extra teacher-forced disagreement with full depth over plain's (plain's own
agreement is the batching noise floor), per exit: (agreement_plain - agreement) / exit
ratio, pooled over the runs by exits. Written into the bundle of the run's target and the
configuration's provider as ``meta["end_to_end"][rule][target]`` with its standard error,
the runs' commands and the date; mode ee (and spec-ee) then refuse that provider and rule at
that target when the estimate is above it by more than two standard errors, unless
--unsafe-exits (early_exit/mode.py: check_end_to_end). Only the metadata changes.

    python scripts/record_exit_error.py docs/bench/ee-spec.json docs/bench/ee-spec-dev.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def estimates(summaries: list[dict]) -> dict[tuple, dict]:
    """(provider, rule, target) -> {exit_error, se, n_exits, source} pooled over runs."""
    from specee_cpp.bench.configs import CONFIGS

    pooled: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0, []])
    for run in summaries:
        confs = run["summary"]["configs"]
        plain = confs["plain"]["agreement"]
        for name, e in confs.items():
            cfg = CONFIGS.get(name)
            if cfg is None or cfg.mode != "ee" or e.get("exit_ratio") in (None, 0):
                continue
            o = cfg.mode_options
            if o.threshold is not None or o.provider is None:
                continue
            key = (o.provider, o.rule, f"{o.max_exit_error:g}")
            exits = e["exit_ratio"] * e["n_gen"]
            pooled[key][0] += max(plain - e["agreement"], 0.0) * e["n_gen"]   # wrong exits
            pooled[key][1] += exits
            pooled[key][2].append((run["settings"]["out"], run["command"]))
    out = {}
    for key, (wrong, exits, cmds) in pooled.items():
        err = wrong / exits
        out[key] = {"exit_error": round(err, 5),
                    "se": round(math.sqrt(max(err * (1 - err), 1e-6) / exits), 5),
                    "n_exits": int(exits), "runs": ", ".join(dict.fromkeys(o for o, _ in cmds)),
                    "source": " ; ".join(dict.fromkeys(c for _, c in cmds)),
                    "date": time.strftime("%Y-%m-%d")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="bench .json outputs")
    ap.add_argument("--dry-run", action="store_true", help="print, write nothing")
    args = ap.parse_args()

    from specee_cpp.early_exit.mode import bundle_path
    from specee_cpp.early_exit.predictor import Predictors
    from specee_cpp.engine.llm import resolve
    from specee_cpp.models.pull import file_sha256

    runs = [json.loads(p.read_text()) for p in args.summaries]
    targets = {r["settings"]["model"] for r in runs}
    if len(targets) != 1:
        sys.exit(f"error: the runs measure different targets: {sorted(targets)}")
    sha = file_sha256(resolve(targets.pop()))
    for (provider, rule, t), m in sorted(estimates(runs).items()):
        print(f"{provider:6s} {rule:9s} target {t}: exits {m['exit_error']:.2%} wrong "
              f"(+-{m['se']:.2%}, {m['n_exits']} exits)")
        if args.dry_run:
            continue
        bundle = bundle_path(sha, provider)
        pred = Predictors.load(bundle)
        pred.meta.setdefault("end_to_end", {}).setdefault(rule, {})[t] = m
        pred.save(bundle)
        print(f"  -> {bundle.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""How often early exits emit another token than full depth on prompts the calibration did
not see, per category, with 95% intervals; optionally recorded in the shipped bundles.

    python scripts/exit_error.py                        # the default pair, both providers
    python scripts/exit_error.py --out docs/bench/exit-error-zen4.json --record

For each provider's shipped bundle, the dev prompts it never saw (neither fitted nor used for
its exit plans: the bundle lists them) are decoded at full depth and replayed layer by layer
(teacher forcing, as calibration does: the probes and argmaxes are exactly those of a
sequential decode), and the exits of each rule at each quality target are simulated as
``ee`` takes them with every allowed layer probed: first layer to fire wins, change feature
from the previous probe (early_exit/calibrate.py: held_out_error). An exit is wrong when its
token is not the full-depth one; the count is exact, with no plain-run noise floor to
subtract. ``--record`` writes the pooled figures into the bundles as
``meta["end_to_end"][rule][target]``; ``spec-ee``, whose exits reach the output, then
refuses a provider and rule whose whole interval lies above the target (early_exit/mode.py:
check_end_to_end); in ``ee``, which checks every exit, the figure is how often a check
undoes one. Records are cached
per prompt as calibration's are: a stopped run resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the default pair's)")
    ap.add_argument("--draft", default=None, help="draft (default: the default pair's)")
    ap.add_argument("--providers", default="draft,ngram")
    ap.add_argument("--targets", default="0.01,0.02,0.05", help="--max-exit-error values")
    ap.add_argument("--per-category", type=int, default=0,
                    help="held-out prompts per category (0: all)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument("--record", action="store_true",
                    help="write the pooled figures into the shipped bundles")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    from specee_cpp.bench.prompts import DEV_PROMPTS, load_spec_bench, per_category
    from specee_cpp.config import LoadConfig
    from specee_cpp.early_exit.calibrate import held_out_error, prompt_key
    from specee_cpp.early_exit.mode import EEOptions, bundle_path, candidates, predictors
    from specee_cpp.early_exit.quality import RULES, plan_for
    from specee_cpp.engine.llm import LLM
    from specee_cpp.models.registry import load_registry
    from specee_cpp.provenance import machine

    target, draft = load_registry().pair("default")
    model, draft = args.model or target.name, args.draft or draft.name
    targets = [float(t) for t in args.targets.split(",")]
    command = "python scripts/exit_error.py " + " ".join(sys.argv[1:])
    result = {"command": command, "date": time.strftime("%Y-%m-%d"), "providers": {}}
    with LLM(model, draft=draft, config=LoadConfig(n_threads=args.threads)) as llm:
        result["machine"] = machine(llm.config.threads)
        for provider in args.providers.split(","):
            pred = predictors(llm, EEOptions(provider=provider))
            seen = set(pred.meta.get("prompts", ()))
            pool = [p for p in load_spec_bench(DEV_PROMPTS) if prompt_key(p.text) not in seen]
            prompts = [(p.category, p.text) for p in per_category(pool, args.per_category)]

            def progress(_: str, done: int, total: int) -> None:
                print(f"\r{provider}: {done}/{total} held-out prompts", end="", file=sys.stderr,
                      flush=True)

            figures = held_out_error(llm, candidates(llm, provider, pred.k), pred, prompts,
                                     targets, progress)
            print(file=sys.stderr)
            for rule in RULES:
                for t, f in figures[rule].items():
                    a = f["all"]
                    print(f"{provider:6s} {rule:9s} target {t}: {a['exits']:4d} exits of "
                          f"{a['tokens']} tokens, {a['wrong']} wrong, error "
                          f"{a['low']:.2%}-{a['high']:.2%} (95%)")
            result["providers"][provider] = figures
            if args.record:
                # keyed by the plan each target ran with, as check_end_to_end looks it up
                bundle = bundle_path(llm.model.sha256, provider)
                pred.meta["end_to_end"] = {
                    rule: {fitted: dict(f["all"], source=command, date=result["date"],
                                        prompts=f"{figures['prompts']} held-out dev prompts")
                           for t, f in figures[rule].items()
                           if (fitted := plan_for(pred.meta["exit_plans"], rule, float(t))[2])}
                    for rule in RULES}
                pred.save(bundle)
                print(f"  -> {bundle.relative_to(REPO)}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130)

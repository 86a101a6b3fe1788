#!/usr/bin/env python3
"""Where the copy model is off: its predicted against observed acceptance by slice of the
dev fitting streams, and the 5-fold held-out replay of the nets with and without the
first-guess scale (``copy_model.first_guess_scale``), under this machine's cost table.

The streams are the ones scripts/fit_copy_model.py profiles and caches (the target's plain
greedy outputs of the dev fitting prompts); a first run profiles them (~15 min on 2 cores).

    python scripts/copy_model_slices.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b:auto

Session 18 (AMX Xeon, 116 streams): the answer's first proposed token, predicted 0.553 on
held-out folds, accepted 0.351; scaled 0.352, replay 1.9085x -> 1.9169x of plain.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_copy_model as fcm  # noqa: E402  (the fitting data's prompts and stream cache)

FOLDS = 5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fcm.add_data_args(ap)
    ns = ap.parse_args()

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.spec import copy_model as cm
    from specee_cpp.spec.mode import cost_model

    def log(msg: str) -> None:
        print(f"[slices] {msg}", file=sys.stderr, flush=True)

    with LLM(ns.target, draft=ns.draft, config=LoadConfig(n_ctx=4096)) as llm:
        data = fcm.streams(llm, fcm.prompts(ns.edit_step), fcm.stream_cache(llm), log)
        table = cost_model(llm)
        eog = llm.model.eog_tokens
    parts = [cm.samples(s["prompt"], s["output"]) for s in data]
    X = np.concatenate([p[0] for p in parts if len(p[1])])
    y = np.concatenate([p[1] for p in parts if len(p[1])])
    guesses, pos = X[:, cm.FEATURES.index("log1p_guesses")], X[:, cm.FEATURES.index("position")]
    few = np.log1p(3) + 1e-9
    slices = {"all": np.ones(len(y), bool), "no guess yet": guesses == 0,
              "no guess yet, first token": (guesses == 0) & (pos == 0),
              "1-3 guesses, first token": (guesses > 0) & (guesses <= few) & (pos == 0),
              "4+ guesses, first token": (guesses > few) & (pos == 0)}
    shipped = cm.CopyModel.load(cm.bundle_path(llm.model.sha256))
    nets_only = cm.CopyModel(shipped.nets, {})
    print(f"shipped nets (in-sample for the streams they were fitted on), {len(data)} streams:")
    for name, m in slices.items():
        print(f"  {name:28} rows {int(m.sum()):6d}  predicted {nets_only.predict(X[m]).mean():.3f}"
              f"  observed {y[m].mean():.3f}")

    speed = {"nets": [0.0, 0.0], "scaled": [0.0, 0.0]}
    first_pred = {"nets": [], "scaled": []}
    first_obs = []
    for fold in range(FOLDS):
        train = [s for i, s in enumerate(data) if i % FOLDS != fold]
        test = [(s, parts[i]) for i, s in enumerate(data) if i % FOLDS == fold]
        fitted = cm.fit(train)
        variants = {"nets": cm.CopyModel(fitted.nets, {"copy_break": fitted.copy_break}),
                    "scaled": fitted}
        for s, (Xs, ys) in test:
            if len(ys):
                sel = cm.first_guess(Xs)
                first_obs += ys[sel].tolist()
            for name, model in variants.items():
                if len(ys):
                    first_pred[name] += model.predict(Xs[sel]).tolist()
                r = cm.simulate(s["prompt"], s["output"], table, model,
                                limit=s.get("max_tokens"), is_eog=eog.__contains__)
                speed[name][0] += r.plain_seconds
                speed[name][1] += r.seconds
        log(f"fold {fold + 1}/{FOLDS}: first_scale {fitted.first_scale:.3f}")
    print(f"{FOLDS}-fold held out, answer's first proposed token: observed "
          f"{np.mean(first_obs):.3f} ({len(first_obs)} rows)")
    for name in speed:
        print(f"  {name:7} predicted {np.mean(first_pred[name]):.3f}, replayed speed-up "
              f"{speed[name][0] / speed[name][1]:.4f}x of plain (all streams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How often exits emit another token than full depth, with the uncertainty of a count, and
the per-layer thresholds that keep it within a quality target.

The target is about the exits a user gets: all of them together, as decoding takes them
(the allowed layers probed in order, the change feature from the previous probe, the first
layer to fire emitting the token). ``simulate`` replays exactly that on teacher-forced
records (calibrate.collect_one), for every token at once. A few dozen exits with none
wrong say little (the error could still be several percent), so a plan is accepted only
where the one-sided upper confidence bound (Clopper-Pearson) of its exits' error is within
the target, and measured errors are reported with their interval.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import EXIT_ERROR_CONFIDENCE, THRESHOLD_GRID
from .features import features

RULES = ("argmax", "candidate")


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                                 + i * lp + (n - i) * lq) for i in range(k + 1)))


def _solve(f, want: float) -> float:
    """p in [0, 1] with f(p) = want, for f decreasing in p (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > want else (lo, mid)
    return (lo + hi) / 2


def upper_bound(wrong: int, n: int, confidence: float = EXIT_ERROR_CONFIDENCE) -> float:
    """One-sided Clopper-Pearson upper bound of an error rate seen as ``wrong`` of ``n``."""
    if n <= 0 or wrong >= n:
        return 1.0
    return _solve(lambda p: _binom_cdf(wrong, n, p), 1.0 - confidence)


def lower_bound(wrong: int, n: int, confidence: float = EXIT_ERROR_CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower bound (0 when nothing was wrong)."""
    if n <= 0 or wrong <= 0:
        return 0.0
    return _solve(lambda p: _binom_cdf(wrong - 1, n, p), confidence)


def interval(wrong: int, n: int, confidence: float = EXIT_ERROR_CONFIDENCE) -> tuple[float, float]:
    """Two-sided interval at ``confidence`` (each side (1 - confidence) / 2)."""
    side = 1.0 - (1.0 - confidence) / 2
    return lower_bound(wrong, n, side), upper_bound(wrong, n, side)


def pooled(records: list[dict]) -> dict:
    """Records joined along their tokens (the fields ``simulate`` reads)."""
    if not records:
        return {"logits": np.zeros((0, 0, 1)), "argmax": np.zeros((0, 0), int),
                "final": np.zeros(0, int), "cand": np.zeros((0, 1), int),
                "n_cand": np.zeros(0, int)}
    return {"logits": np.concatenate([r["logits"] for r in records], axis=1),
            "argmax": np.concatenate([r["argmax"] for r in records], axis=1),
            **{f: np.concatenate([r[f] for r in records]) for f in ("final", "cand", "n_cand")}}


def simulate(pred, rec: dict, layers: list[int], thresholds: dict[int, float],
             rule: str = "argmax") -> np.ndarray:
    """[exit layer (-1: none), emitted the full-depth token] for every token of a record (or
    of ``pooled`` records), probing the layers of ``thresholds`` in order (``layers``: the
    record's layer order). A token without candidates is never probed."""
    cand, n_cand, final = rec["cand"], rec["n_cand"], rec["final"]
    n = len(final)
    real = np.arange(cand.shape[1])[None, :] < n_cand[:, None]
    alive = n_cand > 0
    exits, correct = np.full(n, -1), np.zeros(n, dtype=bool)
    prev = None
    for j, layer in enumerate(layers):
        if layer not in thresholds or not alive.any():
            continue
        lg = rec["logits"][j]
        x, prev = features(lg, prev, pred.k)
        fire = alive & (pred.prob(layer, x) > thresholds[layer])
        if rule == "candidate":   # the top probed candidate, always one
            top = np.where(real, lg[:, :cand.shape[1]], -np.inf).argmax(axis=1)
            tok = cand[np.arange(n), top]
        else:                     # the layer's argmax, only when it is one of the candidates
            tok = rec["argmax"][j]
            fire &= ((cand == tok[:, None]) & real).any(axis=1)
        exits[fire], correct[fire] = layer, tok[fire] == final[fire]
        alive &= ~fire
    return np.stack([exits, correct])


def _measure(sims: np.ndarray) -> dict:
    exits = sims[0] >= 0
    n, wrong = int(exits.sum()), int((exits & ~sims[1].astype(bool)).sum())
    low, high = interval(wrong, n)
    return {"tokens": int(sims.shape[1]), "exits": n, "wrong": wrong,
            "error": wrong / n if n else None, "low": low, "high": high,
            "mean_exit_layer": float(sims[0][exits].mean()) if n else None}


def exit_error(pred, records: list[dict], layers: list[int], thresholds: dict[int, float],
               rule: str = "argmax") -> dict:
    """Tokens, exits and wrong exits over ``records`` with the exit error's interval."""
    return _measure(simulate(pred, pooled(records), layers, thresholds, rule))


def choose_plans(pred, records: list[dict], layers: list[int], rule: str,
                 targets: tuple[float, ...], confidence: float = EXIT_ERROR_CONFIDENCE
                 ) -> dict[str, dict]:
    """Per quality target, per-layer thresholds whose exits, decoded together on
    ``records``, have the upper confidence bound of their error within it: from every
    layer at the loosest threshold of THRESHOLD_GRID, the layer whose exits err most is
    raised one step (or left out past the last) until the bound holds for the loosest
    target, then on for each stricter one. ``{target: {"thresholds", "rates" (each layer's
    share of the tokens exiting there), "exits", "wrong", "tokens"}}``."""
    rec = pooled(records)
    step = {layer: 0 for layer in layers}
    out = {}
    for target in sorted(targets, reverse=True):
        while step:
            th = {layer: THRESHOLD_GRID[i] for layer, i in step.items()}
            sims = simulate(pred, rec, layers, th, rule)
            m = _measure(sims)
            if upper_bound(m["wrong"], m["exits"], confidence) <= target:
                break
            # the layer with the highest error rate among its exits, more wrong ones first
            wrong = {l: int(((sims[0] == l) & ~sims[1].astype(bool)).sum()) for l in step}
            fires = {l: int((sims[0] == l).sum()) for l in step}
            worst = max(step, key=lambda l: (wrong[l] / (fires[l] + 1), wrong[l]))
            step[worst] += 1
            if step[worst] == len(THRESHOLD_GRID):
                del step[worst]
        if not step:
            out[f"{target:g}"] = {"thresholds": {}, "rates": {}, "exits": 0, "wrong": 0,
                                  "tokens": int(len(rec["final"]))}
            continue
        n = max(m["tokens"], 1)
        out[f"{target:g}"] = {"thresholds": {str(l): float(t) for l, t in th.items()},
                              "rates": {str(l): float((sims[0] == l).sum()) / n for l in th},
                              "exits": m["exits"], "wrong": m["wrong"], "tokens": m["tokens"]}
    return {f"{t:g}": out[f"{t:g}"] for t in sorted(targets)}


def plan_for(plans: dict, rule: str, target: float) -> tuple[dict[int, float], dict[int, float],
                                                            str | None]:
    """(thresholds, exit rate per layer, the calibrated target used) for ``--max-exit-error
    target``: the plan of the loosest calibrated target not above it (none below the
    strictest: no exits)."""
    fitted = sorted((float(t), t) for t in plans.get(rule, {}) if float(t) <= target + 1e-12)
    if not fitted:
        return {}, {}, None
    p = plans[rule][fitted[-1][1]]
    return ({int(l): t for l, t in p["thresholds"].items()},
            {int(l): r for l, r in p["rates"].items()}, fitted[-1][1])

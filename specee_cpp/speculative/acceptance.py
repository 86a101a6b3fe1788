"""Acceptance models fitted on `specee-cpp profile` records (dev prompts only).

Round model (SpecKV's controller): features of the previous drafted round (mean and max
entropy, mean and min top-1 probability of the draft, its acceptance rate), the target's
compression level (bits per weight) and a candidate gamma -> the fraction of those gamma
tokens the target will accept. One hidden layer of 16, as in SpecKV.

Token model (for the per-token stop rule): a drafted token's top-1 probability and entropy,
its position and the compression level -> the probability that it is accepted given that
the tokens before it were.

Greedy acceptance of the first g tokens of a round depends only on those tokens, so a round
profiled at gamma G also gives the labels of every g < G (min(accepted, g) / g).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import (CORRECTION_HALF_LIFE, CORRECTION_HI, CORRECTION_LO, CORRECTION_PRIOR,
                      CORRECTION_WINDOW)
from ..errors import SpeceeError
from ..mlp import forward, load_npz, save_npz, train_mlp

MODEL_VERSION = 1
N_ROUND_FEATURES = 6   # mean/max entropy, mean/min top-1, last acceptance rate, bits/weight


def round_stats(top1: list[float], entropy: list[float], n_accept: int) -> list[float]:
    """The five draft-side features of a drafted round (compression level added later)."""
    return [float(np.mean(entropy)), float(np.max(entropy)), float(np.mean(top1)),
            float(np.min(top1)), n_accept / len(top1)]




class Correction:
    """The round model's predictions checked against this pair's drafted rounds. The model
    is fitted on one draft's profiles and serves its variants (a reduced head, another
    quantization) on every kind of prompt: on the Ice Lake Xeon with the 16k-head IQ4_NL
    draft it predicted 1.17-1.42 accepted tokens a round in translation, MT-Bench and QA
    answers where 0.85-1.32 were (a first token accepted at 0.56-0.72 where it said ~0.80),
    and 2.27 on HumanEval where 2.46 were; its rounds outside code were break-even at best.

    The factor that scales the predicted rates is the ratio of accepted to predicted tokens
    over the recent rounds (each older round counts ``1 - 1 / window`` as much as the next),
    shrunk towards 1 as if ``prior`` more rounds had come out as predicted, within
    [lo, hi]: one unlucky round moves it a little, a run of them a lot.

    A factor that stops drafting gets no more rounds to learn from, so the evidence also
    fades with the plain steps taken (halved every ``half_life``): without it the 12
    MT-Bench/QA answers after a first that drafted badly (x0.66) drew 4 model rounds in
    all, and a chat that moved on to code would not have drafted with the model again."""

    def __init__(self, window: int = CORRECTION_WINDOW, prior: float = CORRECTION_PRIOR,
                 lo: float = CORRECTION_LO, hi: float = CORRECTION_HI,
                 half_life: int = CORRECTION_HALF_LIFE):
        self.keep, self.prior, self.lo, self.hi = 1.0 - 1.0 / window, prior, lo, hi
        self.fade = 0.5 ** (1.0 / half_life)
        self.predicted = self.observed = self.rounds = 0.0   # decayed sums

    def observe(self, predicted: float, accepted: int) -> None:
        """A drafted round the model predicted ``predicted`` accepted tokens for."""
        self.predicted = self.keep * self.predicted + predicted
        self.observed = self.keep * self.observed + accepted
        self.rounds = self.keep * self.rounds + 1.0

    def plain_step(self) -> None:
        self.predicted *= self.fade
        self.observed *= self.fade
        self.rounds *= self.fade

    @property
    def factor(self) -> float:
        if self.predicted <= 1e-9:   # nothing predicted yet (or nothing at all)
            return 1.0 if self.observed <= 0 else self.hi
        ratio = self.observed / self.predicted
        f = (self.rounds * ratio + self.prior) / (self.rounds + self.prior)
        return min(max(f, self.lo), self.hi)

    def apply(self, rates: np.ndarray) -> np.ndarray:
        # a rate of 1 would promise every gamma all its tokens: kept below the model's reach
        return np.clip(np.asarray(rates) * self.factor, 0.0, 0.99)


@dataclass
class AcceptanceModel:
    round_net: tuple
    token_net: tuple
    prior: list[float]            # round features before any draft: the training mean
    meta: dict = field(default_factory=dict)

    def rates(self, feats: list[float], gammas: np.ndarray) -> np.ndarray:
        """Predicted acceptance rate for each candidate gamma (one batched forward)."""
        g = np.asarray(gammas, dtype=np.float64)
        X = np.column_stack([np.tile(feats, (len(g), 1)), g])
        return forward(self.round_net, X)

    def token_p(self, top1: float, entropy: float, pos: int, bpw: float) -> float:
        return float(forward(self.token_net, np.array([[top1, entropy, pos, bpw]]))[0])

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        arrays = {f"r{i}": a for i, a in enumerate(self.round_net)}
        arrays |= {f"t{i}": a for i, a in enumerate(self.token_net)}
        save_npz(path, arrays, dict(self.meta, version=MODEL_VERSION, prior=self.prior))

    @classmethod
    def load(cls, path: Path) -> AcceptanceModel:
        names = [f"{p}{i}" for p in "rt" for i in range(6)]
        meta, arrays = load_npz(path, names, "draft-length controller")
        rnet = tuple(arrays[f"r{i}"] for i in range(6))
        tnet = tuple(arrays[f"t{i}"] for i in range(6))
        if meta.get("version") != MODEL_VERSION:
            raise SpeceeError(f"controller {path} has version {meta.get('version')}; this build "
                              f"needs {MODEL_VERSION}: refit with specee-cpp fit-controller")
        return cls(round_net=rnet, token_net=tnet, prior=list(meta["prior"]), meta=meta)


# -- data ----------------------------------------------------------------------------------

def rounds_by_run(records: list[dict]) -> dict[tuple, list[dict]]:
    """Profile records grouped by generation (prompt, gamma, target), in decoding order."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        runs[(r["prompt_id"], r["gamma"], r.get("target_quant"), r.get("target_bpw"))].append(r)
    return runs


def round_dataset(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(features + candidate gamma, acceptance rate) pairs: the features of each round's
    predecessor, labels of the round itself for every g up to its gamma."""
    X, y = [], []
    for (_, gamma, _, bpw), rounds in rounds_by_run(records).items():
        for prev, cur in zip(rounds, rounds[1:]):
            feats = round_stats(prev["draft_top1"], prev["draft_entropy"], prev["n_accept"]) + [bpw]
            for g in range(1, cur["gamma"] + 1):
                X.append(feats + [g])
                y.append(min(cur["n_accept"], g) / g)
    return np.array(X), np.array(y)


def token_dataset(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(top-1, entropy, position, bits/weight) of each drafted token the target judged
    (those up to the first rejection) -> accepted."""
    X, y = [], []
    for r in records:
        for j in range(min(r["n_accept"] + 1, r["gamma"])):
            X.append([r["draft_top1"][j], r["draft_entropy"][j], j, r["target_bpw"]])
            y.append(float(j < r["n_accept"]))
    return np.array(X), np.array(y)


def _ignore_constant(net: tuple) -> tuple:
    """A feature that never varied in training (e.g. one quantization level profiled) has a
    near-zero scale; zero its weights so that another value at run time is ignored instead
    of being blown up by 1 / sigma."""
    mu, sigma, W1, b1, W2, b2 = net
    const = sigma < 1e-3
    W1 = np.where(const[:, None], 0.0, W1)
    return mu, np.where(const, 1.0, sigma), W1, b1, W2, b2


def fit(records: list[dict], hidden: int = 16, epochs: int = 80, seed: int = 0,
        meta: dict | None = None) -> AcceptanceModel:
    """Fit both models on profile records (which must carry ``target_bpw``)."""
    missing = [r for r in records if "target_bpw" not in r]
    if missing:
        raise SpeceeError(f"{len(missing)} profile records lack target_bpw; re-profile with "
                          f"this version of specee-cpp profile")
    Xr, yr = round_dataset(records)
    Xt, yt = token_dataset(records)
    if len(Xr) < 50 or len(Xt) < 50:
        raise SpeceeError(f"too few profile rounds to fit a controller ({len(Xr)} round and "
                          f"{len(Xt)} token samples); profile more prompts")
    rnet = _ignore_constant(train_mlp(Xr, yr, hidden=hidden, epochs=epochs, seed=seed))
    tnet = _ignore_constant(train_mlp(Xt, yt, hidden=hidden, epochs=epochs, seed=seed))
    prior = Xr[:, :N_ROUND_FEATURES].mean(axis=0).tolist()
    quants = sorted({(r.get("target_quant"), r["target_bpw"]) for r in records})
    info = {"n_round_samples": len(Xr), "n_token_samples": len(Xt),
            "quants": [[q, b] for q, b in quants], "hidden": hidden}
    return AcceptanceModel(rnet, tnet, prior, dict(meta or {}, **info))


def held_out_report(records: list[dict], meta: dict | None = None) -> dict:
    """Fit without every fifth prompt (from the second, so that the held-out prompts span
    the task types) and score on those: the round model's acceptance-rate MAE against a
    constant (the training mean) and the token model's accuracy against the base rate."""
    pids = sorted({r["prompt_id"] for r in records})
    held = set(pids[1::5])
    train = [r for r in records if r["prompt_id"] not in held]
    test = [r for r in records if r["prompt_id"] in held]
    model = fit(train, meta=meta)
    report: dict = {"held_out_prompts": sorted(held), "n_train_rounds": len(train),
                    "n_train_prompts": len(pids) - len(held)}
    Xr, yr = round_dataset(test)
    if len(Xr):
        report["rate_mae"] = float(np.mean(np.abs(forward(model.round_net, Xr) - yr)))
        report["rate_mae_constant"] = float(np.mean(np.abs(np.mean(round_dataset(train)[1]) - yr)))
    Xt, yt = token_dataset(test)
    if len(Xt):
        pt = forward(model.token_net, Xt)
        report["token_accuracy"] = float(np.mean((pt > 0.5) == (yt > 0.5)))
        report["token_base_rate"] = float(np.mean(yt))
    return report


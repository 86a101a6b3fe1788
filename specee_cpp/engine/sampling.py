"""Token selection from logits. ``make_sampler`` returns a plain callable, as in mlx-lm."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import SamplingConfig

Sampler = Callable[[np.ndarray], int]          # logits -> token
Picker = Callable[..., int]                     # (Sequence, output index=-1) -> token


def probs(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The distribution that sampling with ``cfg`` draws from (temperature, top-k, top-p).

    Greedy configs give a one-hot distribution, so speculative acceptance rules that compare
    distributions work unchanged for greedy decoding.
    """
    if cfg.greedy:
        p = np.zeros(logits.shape[-1], dtype=np.float64)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / cfg.temperature
    if 0 < cfg.top_k < z.shape[-1]:
        kth = np.partition(z, -cfg.top_k)[-cfg.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = int(np.searchsorted(cum, cfg.top_p)) + 1
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:n_keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def make_picker(cfg: SamplingConfig) -> Picker:
    """A callable (sequence, output index) -> the next token: greedy takes the argmax in C
    without copying the n_vocab logits; sampling draws from a copy of them."""
    if cfg.greedy:
        return lambda seq, i=-1: seq.argmax(i)
    sample = make_sampler(cfg)
    return lambda seq, i=-1: sample(seq.logits(i))


def make_sampler(cfg: SamplingConfig) -> Sampler:
    """A callable logits -> token id; greedy is argmax, otherwise seeded random draws."""
    if cfg.greedy:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(cfg.seed)

    def sample(logits: np.ndarray) -> int:
        p = probs(logits, cfg)
        return int(rng.choice(p.shape[-1], p=p))

    return sample

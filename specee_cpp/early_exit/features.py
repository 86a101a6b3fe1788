"""SpecEE's predictor features at one probed layer, computed the same way at calibration and
at decoding time.

For k candidates: their logits at the layer (final norm applied), their softmax over the k
only, and the change of that softmax since the previously probed layer of the same token
(against the uniform distribution at the first probe). Fewer than k candidates are padded
with a logit far below the others, so the padding carries no probability.
"""
from __future__ import annotations

import numpy as np

from ..config import PAD_GAP

FEATURE_VERSION = 1


def pad_logits(logits: np.ndarray, k: int) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape[-1] >= k:
        return logits[..., :k]
    low = logits.min(axis=-1, keepdims=True) - PAD_GAP
    pad = np.broadcast_to(low, logits.shape[:-1] + (k - logits.shape[-1],))
    return np.concatenate([logits, pad], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def features(logits: np.ndarray, prev_softmax: np.ndarray | None, k: int):
    """(features (..., 3k), softmax (..., k)) for candidate logits (..., <=k)."""
    lg = pad_logits(logits, k)
    sm = softmax(lg)
    prev = np.full_like(sm, 1.0 / k) if prev_softmax is None else prev_softmax
    return np.concatenate([lg, sm, sm - prev], axis=-1), sm

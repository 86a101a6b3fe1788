"""The one small MLP both predictor families use: features -> hidden (ReLU) -> 1 (sigmoid).

Early-exit predictors (``early_exit.predictor``, one per layer) and the draft-length acceptance
models (``speculative.acceptance``) are this network, trained here with numpy Adam on binary
cross-entropy and stored in a compressed ``.npz`` with JSON metadata, written atomically.
A network is the tuple (mu, sigma, W1, b1, W2, b2): input normalisation and two layers.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import SpeceeError

Net = tuple  # (mu, sigma, W1, b1, W2, b2)


def forward(net: Net, X: np.ndarray) -> np.ndarray:
    """sigmoid(relu(((X - mu) / sigma) @ W1 + b1) @ W2 + b2), batched over X's rows."""
    mu, sigma, W1, b1, W2, b2 = net
    h = np.maximum(((X - mu) / sigma) @ W1 + b1, 0.0)
    # the logistic function as tanh: no overflow for large negative logits (1 / (1 + exp(-z))
    # overflows exp past z = -709, e.g. an input far outside the fitting data)
    return 0.5 * (1.0 + np.tanh(0.5 * (h @ W2 + b2)))


def stack(nets: list[Net]) -> Net:
    """An ensemble of nets (same inputs) as one: each member's input normalisation folded
    into its first layer, the first layers side by side, the second block-diagonal, so that
    ``forward_mean`` takes two matrix products where a loop over members took two each and
    as many normalisations (a copy-model prediction every round of a generation, where
    numpy's per-call overhead, not arithmetic, is the cost)."""
    W1 = np.concatenate([w1 / sg[:, None] for mu, sg, w1, b1, w2, b2 in nets], axis=1)
    b1 = np.concatenate([b1 - (mu / sg) @ w1 for mu, sg, w1, b1, w2, b2 in nets])
    W2 = np.zeros((W1.shape[1], len(nets)))
    at = 0
    for k, (_, _, w1, _, w2, _) in enumerate(nets):
        W2[at:at + w1.shape[1], k] = np.ravel(w2)
        at += w1.shape[1]
    b2 = np.array([float(np.ravel(net[5])[0]) for net in nets])
    return (W1, b1, W2, b2)


def forward_mean(stacked: tuple, X: np.ndarray) -> np.ndarray:
    """The mean of the members' ``forward`` outputs, from ``stack(members)``."""
    W1, b1, W2, b2 = stacked
    h = np.maximum(X @ W1 + b1, 0.0)
    return (0.5 * (1.0 + np.tanh(0.5 * (h @ W2 + b2)))).mean(axis=1)


def train_mlp(X: np.ndarray, y: np.ndarray, hidden: int = 128, epochs: int = 100,
              lr: float = 1e-3, batch: int = 1024, seed: int = 0):
    """Fit one predictor: returns (mu, sigma, W1, b1, W2, b2). BCE with logits, Adam."""
    rng = np.random.default_rng(seed)
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mu, sigma = X.mean(axis=0), X.std(axis=0) + 1e-6
    Z = (X - mu) / sigma
    d = X.shape[1]
    params = [rng.standard_normal((d, hidden)) * np.sqrt(2.0 / d), np.zeros(hidden),
              rng.standard_normal(hidden) * np.sqrt(1.0 / hidden), np.zeros(1)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    b1_, b2_, eps, t = 0.9, 0.999, 1e-8, 0
    n = len(Z)
    # calibration sets are small: smaller batches so that each epoch still takes several steps
    batch = max(32, min(batch, n // 8))
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(0, n, batch):
            idx = order[s:s + batch]
            xb, yb = Z[idx], y[idx]
            W1, b1, W2, b2 = params
            pre = xb @ W1 + b1
            h = np.maximum(pre, 0.0)
            logit = h @ W2 + b2[0]
            p = 1.0 / (1.0 + np.exp(-logit))
            g = (p - yb) / len(idx)                   # d BCE / d logit
            gW2 = h.T @ g
            gb2 = np.array([g.sum()])
            gh = np.outer(g, W2) * (pre > 0)
            grads = [xb.T @ gh, gh.sum(axis=0), gW2, gb2]
            t += 1
            for i, gr in enumerate(grads):
                m[i] = b1_ * m[i] + (1 - b1_) * gr
                v[i] = b2_ * v[i] + (1 - b2_) * gr * gr
                mh, vh = m[i] / (1 - b1_ ** t), v[i] / (1 - b2_ ** t)
                params[i] = params[i] - lr * mh / (np.sqrt(vh) + eps)
    W1, b1, W2, b2 = params
    return mu, sigma, W1, b1, W2, b2[0]


def save_npz(path: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Arrays as float32 plus ``meta`` as JSON; the file appears only once complete."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)),
                        **{k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()})
    tmp.replace(path)


def load_npz(path: Path, names: list[str] | None, what: str
             ) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays as float64) of a file written by :func:`save_npz`: those in ``names``,
    or with None every one the file holds besides the meta; ``what`` names the kind
    of file in the one-line error for a missing or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise SpeceeError(f"{what} not found: {path}")
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            keys = [k for k in z.files if k != "meta"] if names is None else names
            arrays = {k: z[k].astype(np.float64) for k in keys}
    except (OSError, ValueError, KeyError) as e:
        raise SpeceeError(f"not a {what} file: {path} ({e})") from None
    return meta, arrays

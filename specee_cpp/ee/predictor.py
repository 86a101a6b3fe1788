"""Per-layer exit predictors: one small MLP per layer (3k -> hidden -> 1, sigmoid), trained
with our own numpy Adam on binary cross-entropy, stored with their metadata.

A bundle is refused when it does not match the loaded target (sha256 of the GGUF, layer
count) or the feature definition, so a predictor is never applied to a model it was not
fitted on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpeceeError
from .features import FEATURE_VERSION

BUNDLE_VERSION = 1


@dataclass
class Predictors:
    layers: list[int]            # layers with a predictor, ascending
    k: int
    mu: np.ndarray               # (n, 3k) feature normalisation
    sigma: np.ndarray            # (n, 3k)
    W1: np.ndarray               # (n, 3k, hidden)
    b1: np.ndarray               # (n, hidden)
    W2: np.ndarray               # (n, hidden)
    b2: np.ndarray               # (n,)
    threshold: float = 0.5
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._row = {l: i for i, l in enumerate(self.layers)}

    def has(self, layer: int) -> bool:
        return layer in self._row

    def prob(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Exit probability at ``layer`` for features x (..., 3k)."""
        i = self._row[layer]
        z = (x - self.mu[i]) / self.sigma[i]
        h = np.maximum(z @ self.W1[i] + self.b1[i], 0.0)
        return 1.0 / (1.0 + np.exp(-(h @ self.W2[i] + self.b2[i])))

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path = Path(path)
        meta = dict(self.meta, bundle_version=BUNDLE_VERSION, feature_version=FEATURE_VERSION,
                    k=self.k, layers=self.layers, threshold=self.threshold)
        tmp = path.with_name(path.name + ".partial.npz")
        np.savez_compressed(tmp, mu=self.mu.astype(np.float32), sigma=self.sigma.astype(np.float32),
                            W1=self.W1.astype(np.float32), b1=self.b1.astype(np.float32),
                            W2=self.W2.astype(np.float32), b2=self.b2.astype(np.float32),
                            meta=np.array(json.dumps(meta)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Predictors:
        path = Path(path)
        if not path.is_file():
            raise SpeceeError(f"predictor bundle not found: {path}")
        try:
            with np.load(path) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k].astype(np.float64) for k in ("mu", "sigma", "W1", "b1", "W2", "b2")}
        except (OSError, ValueError, KeyError) as e:
            raise SpeceeError(f"not a predictor bundle: {path} ({e})") from None
        if meta.get("bundle_version") != BUNDLE_VERSION or meta.get("feature_version") != FEATURE_VERSION:
            raise SpeceeError(f"predictor bundle {path} has version {meta.get('bundle_version')}"
                              f"/features {meta.get('feature_version')}; this build needs "
                              f"{BUNDLE_VERSION}/{FEATURE_VERSION}: recalibrate")
        return cls(layers=[int(l) for l in meta["layers"]], k=int(meta["k"]),
                   threshold=float(meta["threshold"]), meta=meta, **arrays)

    def check_target(self, sha256: str, n_layer: int, path: Path | str = "") -> None:
        """Refuse a bundle fitted on another model."""
        want = self.meta.get("target_sha256")
        if want != sha256 or self.meta.get("n_layer") != n_layer:
            raise SpeceeError(
                f"predictor bundle was fitted on {self.meta.get('target_name', '?')} "
                f"(sha256 {str(want)[:12]}, {self.meta.get('n_layer')} layers), not on the "
                f"loaded target {Path(path).name} (sha256 {sha256[:12]}, {n_layer} layers)")


# -- training ------------------------------------------------------------------------------

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


def stack(layers: list[int], fitted: list[tuple], k: int, threshold: float, meta: dict) -> Predictors:
    cols = list(zip(*fitted))
    return Predictors(layers=layers, k=k, mu=np.stack(cols[0]), sigma=np.stack(cols[1]),
                      W1=np.stack(cols[2]), b1=np.stack(cols[3]), W2=np.stack(cols[4]),
                      b2=np.array(cols[5]), threshold=threshold, meta=meta)

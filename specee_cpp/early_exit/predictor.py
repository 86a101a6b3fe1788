"""Per-layer exit predictors: one small MLP per layer (3k -> hidden -> 1, sigmoid), trained
with our own numpy Adam on binary cross-entropy, stored with their metadata.

A bundle is refused when it does not match the loaded target (sha256 of the GGUF, layer
count) or the feature definition, so a predictor is never applied to a model it was not
fitted on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpeceeError
from ..mlp import forward, load_npz, save_npz
from .features import FEATURE_VERSION

BUNDLE_VERSION = 1
_ARRAYS = ("mu", "sigma", "W1", "b1", "W2", "b2")


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

    def prob(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Exit probability at ``layer`` for features x (..., 3k)."""
        i = self._row[layer]
        return forward((self.mu[i], self.sigma[i], self.W1[i], self.b1[i], self.W2[i],
                        self.b2[i]), x)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Path) -> None:
        meta = dict(self.meta, bundle_version=BUNDLE_VERSION, feature_version=FEATURE_VERSION,
                    k=self.k, layers=self.layers, threshold=self.threshold)
        save_npz(path, {k: getattr(self, k) for k in _ARRAYS}, meta)

    @classmethod
    def load(cls, path: Path) -> Predictors:
        meta, arrays = load_npz(path, list(_ARRAYS), "predictor bundle")
        if (meta.get("bundle_version") != BUNDLE_VERSION
                or meta.get("feature_version") != FEATURE_VERSION):
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


def stack(layers: list[int], fitted: list[tuple], k: int, threshold: float,
          meta: dict) -> Predictors:
    cols = list(zip(*fitted))
    return Predictors(layers=layers, k=k, mu=np.stack(cols[0]), sigma=np.stack(cols[1]),
                      W1=np.stack(cols[2]), b1=np.stack(cols[3]), W2=np.stack(cols[4]),
                      b2=np.array(cols[5]), threshold=threshold, meta=meta)

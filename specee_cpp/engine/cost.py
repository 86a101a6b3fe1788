"""Per-machine cost model for speculative decoding, measured once per model pair and cached.

Target: seconds to decode a batch of n tokens (n = 1..16) at the current context, as the
verification of n-1 drafted tokens costs; draft: seconds per drafted token. With per-token
acceptance a, draft length g, draft cost c and verification cost v(g+1), the expected speed
in tokens per second of one round is

    E[tokens] / time = ((1 - a^(g+1)) / (1 - a)) / (g * c + v(g + 1))

and g = 0 is plain decoding (1 / v(1)). On a 2-core CPU v grows fast with n, so short drafts
(often none) win; on a GPU v is nearly flat and longer drafts pay.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..paths import home

N_MAX = 16


@dataclass(frozen=True)
class CostModel:
    target_batch_s: list[float]   # index n-1: seconds for a batch of n tokens
    draft_token_s: float
    key: str = ""

    def verify(self, n: int) -> float:
        """Seconds for a target batch of n tokens (linear extrapolation past the table)."""
        t = self.target_batch_s
        if n <= len(t):
            return t[n - 1]
        slope = (t[-1] - t[-2]) if len(t) > 1 else t[-1]
        return t[-1] + slope * (n - len(t))

    def expected_tps(self, accept: float, gamma: int) -> float:
        """Expected tokens per second of draft length gamma at per-token acceptance accept."""
        if gamma == 0:
            return 1.0 / self.verify(1)
        a = min(max(accept, 0.0), 1.0 - 1e-9)
        tokens = (1.0 - a ** (gamma + 1)) / (1.0 - a)
        return tokens / (gamma * self.draft_token_s + self.verify(gamma + 1))

    def best_gamma(self, accept: float, gammas=range(0, 9)) -> int:
        return max(gammas, key=lambda g: self.expected_tps(accept, g))


def cache_path(key: str) -> Path:
    return home() / "costs" / f"{key}.json"


def load_or_measure(key: str, measure) -> CostModel:
    """The cached model for ``key`` (model files + threads), measuring it on first use."""
    path = cache_path(key)
    try:
        return CostModel(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    model = measure()
    model = CostModel(model.target_batch_s, model.draft_token_s, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(asdict(model)))
    tmp.replace(path)
    return model


def measure(tgt_seq, dft_seq, tokens: list[int], repeats: int = 3) -> CostModel:
    """Time target batches of 1..N_MAX tokens and single draft decodes after ``tokens``
    (both caches prefilled with them), median of ``repeats``; caches are left as found."""
    tgt_seq.prefill(tokens)
    dft_seq.prefill(tokens)
    base_t, base_d = len(tgt_seq.tokens), len(dft_seq.tokens)
    filler = (tokens * (N_MAX // max(len(tokens), 1) + 1))[:N_MAX]
    batch = []
    for n in range(1, N_MAX + 1):
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tgt_seq.feed(filler[:n], all_logits=True)
            runs.append(time.perf_counter() - t0)
            tgt_seq.rewind(base_t)
        batch.append(float(np.median(runs)))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in filler[:4]:
            dft_seq.feed([t])
        runs.append((time.perf_counter() - t0) / 4)
        dft_seq.rewind(base_d)
    return CostModel(target_batch_s=batch, draft_token_s=float(np.median(runs)))

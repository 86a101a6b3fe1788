"""Configuration dataclasses: every default lives here, once."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import SpeceeError

# Defaults shared by several modules, each written here once.
N_CTX = 4096          # context window of a session (chat, generate, bench, profile)
N_BATCH = 512         # tokens per llama_decode batch
N_CTX_COSTS = 2048    # context of a `costs` measurement (a short chat turn fits)
# the prompt whose tokens, repeated, fill the caches of a cost measurement (speculative/cost.py), a
# draft variant's screen (speculative/variants.py) and the draft's attention timing
# (engine/draft_attention.py); and the contexts they are measured at: a short chat turn and a
# long one (a 1k-token cache makes a token measurably dearer)
COST_PROMPT = "Write a function that parses a date and explain it."
COST_CONTEXTS = (128, 1024)
N_CAND = 4            # candidates per token that early-exit predictors see (SpecEE's top-4)
# early exit's quality target: at most this fraction of a layer's exits may emit another
# token than full depth would (on held-out calibration prompts); docs/early-exit.md
MAX_EXIT_ERROR = 0.01
MAX_GAMMA = 8         # longest draft the draft-length policies consider
MAX_VERIFY = 16       # largest target batch the cost model measures one by one (15 drafts)
# free drafts from the context may run longer: a long copy verified in one batch of up to 64
# (on a 2-core CPU a row of a 48-row batch costs 0.41 of a token, of a 16-row one 0.51),
# measured at these sizes and interpolated between them
LONG_BATCHES = (24, 32, 48, 64)
MAX_FREE_VERIFY = LONG_BATCHES[-1]
FIXED_GAMMAS = (1, 2, 3, 4, 6, MAX_GAMMA)  # fixed draft lengths profiled and benchmarked


def default_threads() -> int:
    # llama.cpp decode is memory-bound; more than 8 threads rarely helps on a laptop.
    return max(1, min(os.cpu_count() or 1, 8))


@dataclass(frozen=True)
class LoadConfig:
    """How models are loaded and how big their context is."""

    n_ctx: int = N_CTX
    n_batch: int = N_BATCH
    n_threads: int = 0            # 0: default_threads()
    n_gpu_layers: int = 0         # -1: offload every layer (CUDA/Metal builds)
    # map the GGUF file (True) or read the weights into private memory on huge pages
    # (False); None: memory.private_weights decides per model
    mmap: bool | None = None

    def __post_init__(self) -> None:
        if self.n_ctx < 16:
            raise SpeceeError(f"n_ctx must be at least 16, got {self.n_ctx}")
        if self.n_batch < 1:
            raise SpeceeError(f"n_batch must be positive, got {self.n_batch}")
        if self.n_threads < 0:
            raise SpeceeError(f"n_threads must be >= 0, got {self.n_threads}")

    @property
    def threads(self) -> int:
        return self.n_threads or default_threads()


@dataclass(frozen=True)
class SamplingConfig:
    """Token selection. temperature 0 is greedy (argmax), which is deterministic."""

    temperature: float = 0.0
    top_k: int = 0                # 0: whole vocabulary
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpeceeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed < 0:
            raise SpeceeError(f"seed must be >= 0, got {self.seed}")
        if self.top_k < 0:
            raise SpeceeError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpeceeError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

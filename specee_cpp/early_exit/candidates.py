"""Candidate providers: who proposes the few next tokens whose logits the probes look at.

A provider follows the emitted tokens (``reset`` with the prompt, ``accept`` each token) and
``propose`` returns up to k candidate ids for the next token, in a fixed order (the order
the features use at every probed layer of that token).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import N_CAND
from ..engine.sequence import Sequence


class CandidateProvider(Protocol):
    k: int
    name: str

    def reset(self, prompt: list[int]) -> None: ...

    def propose(self) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first."""
    idx = np.argpartition(-logits, k - 1)[:k]
    return idx[np.argsort(-logits[idx], kind="stable")].astype(np.int32)


class DraftCandidates:
    """The draft model's top-k next tokens; its KV cache follows the emitted tokens."""

    name = "draft"

    def __init__(self, seq: Sequence, k: int = N_CAND):
        self.seq, self.k = seq, k
        self._logits: np.ndarray | None = None
        self._pending: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        self._logits = self.seq.prefill(prompt)
        self._pending = []

    def accept(self, token: int) -> None:
        # decoded lazily in propose(): the last token of a generation is never paid for, and
        # tokens decoded without candidates (no layer paid) are caught up in one batch
        self._pending.append(token)

    def propose(self) -> np.ndarray:
        if self._pending:
            self._logits = self.seq.feed(self._pending)
            self._pending = []
        return top_k(self._logits, self.k)


class NgramCandidates:
    """Prompt lookup: the tokens that followed the latest n-gram (n_max..1) earlier in the
    context, most recent first. Free, and often empty (then nothing is probed)."""

    name = "ngram"

    def __init__(self, k: int = N_CAND, n_max: int = 3):
        self.k, self.n_max = k, n_max
        self.tokens: list[int] = []
        self._index: list[dict[tuple, list[int]]] = []

    def reset(self, prompt: list[int]) -> None:
        self.tokens = []
        # _index[n][gram] = positions just after each occurrence of the n-gram
        self._index = [dict() for _ in range(self.n_max + 1)]
        for t in prompt:
            self.accept(t)

    def accept(self, token: int) -> None:
        # index the n-grams that end just before this token, pointing at it
        n_tok = len(self.tokens)
        for n in range(1, self.n_max + 1):
            if n_tok >= n:
                self._index[n].setdefault(tuple(self.tokens[n_tok - n:]), []).append(n_tok)
        self.tokens.append(token)

    def propose(self) -> np.ndarray:
        out: list[int] = []
        for n in range(self.n_max, 0, -1):
            if len(self.tokens) < n:
                continue
            for pos in reversed(self._index[n].get(tuple(self.tokens[-n:]), ())):
                t = self.tokens[pos]
                if t not in out:
                    out.append(t)
                    if len(out) == self.k:
                        return np.array(out, dtype=np.int32)
        return np.array(out, dtype=np.int32)

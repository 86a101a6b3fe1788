"""The opt-in store of this user's earlier outputs, a source of free drafts in later sessions
(SuffixDecoding's global tree, arXiv 2411.04975: people ask for the same code, the same
boilerplate, the same phrasing again).

One file per tokenizer, ``$SPECEE_CPP_HOME/history/<tokenizer fingerprint>.tokens``: int32
token ids, each output followed by -1. Bounded (the most recent ``max_tokens`` tokens of
whole outputs are kept), written whole under a temporary name and renamed (an interrupted
write leaves the previous file), safe to delete at any time, never sent anywhere: it is read
only to build a suffix trie in this process.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import HISTORY_MAX_TOKENS, TRIE_DEPTH
from ..paths import home
from .context_drafter import SuffixTrie

SEP = -1


def history_dir() -> Path:
    return home() / "history"


class History:
    def __init__(self, fingerprint: str, max_tokens: int = HISTORY_MAX_TOKENS,
                 directory: Path | None = None):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.path = (directory or history_dir()) / f"{fingerprint}.tokens"
        self.max_tokens = max_tokens

    def outputs(self) -> list[list[int]]:
        """The stored outputs, oldest first (an unreadable file counts as empty)."""
        try:
            data = np.fromfile(self.path, dtype=np.int32)
        except (OSError, ValueError):
            return []
        out, start = [], 0
        for end in np.flatnonzero(data == SEP):
            if end > start:
                out.append(data[start:end].tolist())
            start = end + 1
        return out   # a torn tail without its -1 is dropped

    def add(self, tokens: list[int]) -> None:
        """Append one output; the oldest outputs go when the store is over its bound."""
        if not tokens:
            return
        kept = self.outputs() + [list(tokens)[-self.max_tokens:]]
        total = 0
        for i in range(len(kept) - 1, -1, -1):
            total += len(kept[i])
            if total > self.max_tokens:
                kept = kept[i + 1:]
                break
        data = np.fromiter((t for o in kept for t in (*o, SEP)), dtype=np.int32)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        data.tofile(tmp)
        os.replace(tmp, self.path)

    def trie(self, depth: int = TRIE_DEPTH) -> SuffixTrie:
        """A suffix trie over the stored outputs, no substring spanning two of them."""
        t = SuffixTrie(depth)
        for o in self.outputs():
            t.extend(o)
            t.cut()
        return t

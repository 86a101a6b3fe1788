"""The tokens held in a context's KV cache, fed in batches and rewound on demand."""
from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from ..bindings import Batch, Context
from ..errors import SpeceeError


def common_prefix(a: Seq, b: Seq) -> int:
    """Length of the common prefix of two sequences (token ids, or texts)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Sequence:
    """Sequence 0 of a context. ``tokens`` is exactly what the KV cache holds: it is
    extended only after a successful decode and cut together with the cache."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.tokens: list[int] = []
        self.reused = 0     # prompt tokens the last prefill found cached (not decoded)
        self._batch = Batch(ctx.n_batch)

    def rewind(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` tokens in the cache, drop the rest.

        Always clears the cache from ``n_keep`` on, even past ``tokens``: an interrupt between
        a decode and the bookkeeping after it can leave cells that ``tokens`` does not list.
        """
        self.ctx.seq_rm(n_keep)
        del self.tokens[n_keep:]

    def decode(self, tokens: list[int], all_outputs: bool = False) -> None:
        """Decode ``tokens`` after the cached ones; outputs for the last token, or with
        ``all_outputs`` for every one (then ``tokens`` must fit one batch: verification).
        Read them with :meth:`argmax` (greedy, in C) or :meth:`logits` (a copy)."""
        if not tokens:
            raise SpeceeError("decode() needs at least one token")
        if all_outputs and len(tokens) > self.ctx.n_batch:
            raise SpeceeError(f"{len(tokens)} tokens with all outputs exceed n_batch "
                              f"{self.ctx.n_batch}")
        i = 0
        while i < len(tokens):
            chunk = tokens[i:i + self.ctx.n_batch]
            self._batch.set(chunk, len(self.tokens), output_last_only=not all_outputs)
            # a slot's step may take the first rows of a prompt's chunk only (slots.py)
            n = self.ctx.decode(self._batch) or len(chunk)
            self.tokens.extend(chunk[:n])
            i += n

    def decode_greedy(self, tokens: list[int]) -> list[int]:
        """Decode ``tokens`` in one batch and return the greedy token after each of them
        (read in C): a full greedy verification, or a teacher-forced pass."""
        self.decode(tokens, all_outputs=True)
        return [self.ctx.argmax(j) for j in range(len(tokens))]

    def timed_greedy(self, tokens: list[int]) -> float:
        """Seconds to decode ``tokens`` as one greedy batch (a verification of len - 1
        drafted tokens; one token: a plain step), the cache then cut back to where it was:
        what the measurement scripts time, batch after batch at the same context."""
        keep = len(self.tokens)
        t0 = time.perf_counter()
        self.decode_greedy(tokens)
        dt = time.perf_counter() - t0
        self.rewind(keep)
        return dt

    def argmax(self, i: int = -1) -> int:
        """Greedy token of output ``i`` of the last decode, without copying its logits."""
        return self.ctx.argmax(i)

    def confidence(self, i: int = -1) -> tuple[int, float, float]:
        """(greedy token, top-1 probability, entropy) of output ``i``, read in C."""
        return self.ctx.confidence(i)

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of output ``i``'s logits (sampling, confidence, probes)."""
        return self.ctx.logits(i)

    def feed(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """:meth:`decode`, then the logits of the last token, or with ``all_logits`` a
        (len(tokens), n_vocab) array."""
        self.decode(tokens, all_outputs=all_logits)
        if all_logits:
            return np.stack([self.ctx.logits(j) for j in range(len(tokens))])
        return self.ctx.logits(-1)

    def begin_staged(self, tokens: list[int], all_logits: bool = False) -> None:
        """Start a staged decode of ``tokens`` after the cached ones; the caller runs the
        layers (Context.stage_*). The cells are allocated now, so ``tokens`` counts them;
        ``abort_staged`` undoes both."""
        self._batch.set(tokens, len(self.tokens), output_last_only=not all_logits)
        self.ctx.stage_begin(self._batch)
        self.tokens.extend(tokens)

    def abort_staged(self, n_tokens: int) -> None:
        """Drop an unfinished staged decode of the last ``n_tokens`` (open, or already
        aborted by a failed segment)."""
        self.ctx.stage_abort()
        self.rewind(len(self.tokens) - n_tokens)

    def prefill(self, prompt: list[int], read: bool = True) -> np.ndarray | None:
        """Make the cache hold exactly ``prompt``, reusing the longest cached prefix.

        Returns the logits after the last prompt token (None with ``read`` False: take the
        greedy token with :meth:`argmax`).
        """
        if not prompt:
            raise SpeceeError("empty prompt")
        # Re-decode at least the last token: its logits are needed and are not cached.
        n_keep = self.reused = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        self.rewind(n_keep)
        self.decode(prompt[n_keep:])
        return self.logits() if read else None

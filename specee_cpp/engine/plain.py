"""Plain decoding: one target decode per token."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from .modes import Mode, register
from .sampling import Sampler, make_sampler
from .steps import Step

if TYPE_CHECKING:  # the plain mode registers without loading libllama
    from .sequence import Sequence


def generate_plain(seq: Sequence, prompt: list[int], sampler: Sampler) -> Iterator[Step]:
    """Yield tokens forever (the stream wrapper stops it). Each step's timings are the time
    spent producing that token: the prefill for the first, one decode for the others."""
    t0 = time.perf_counter()
    logits = seq.prefill(prompt)
    timings = {"prefill": time.perf_counter() - t0}
    while True:
        token = sampler(logits)
        yield Step(token=token, timings=timings)
        # The token is decoded only when the next one is asked for, so a stopped
        # generation never pays for a decode it does not use.
        t0 = time.perf_counter()
        logits = seq.feed([token])
        timings = {"decode": time.perf_counter() - t0}


class Plain(Mode):
    """The reference every other mode is measured (and, if lossless, checked) against."""

    name = "plain"
    help = "one target decode per token"

    def start(self, llm, sampling, opts):
        sampler = make_sampler(sampling)
        return lambda tokens: generate_plain(llm.tgt.seq, tokens, sampler)


PLAIN = register(Plain())

"""Plain decoding: one target decode per token."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from .modes import Mode, register
from .predicted import predicted_loop
from .sampling import Picker, make_picker
from .steps import Step, with_note

if TYPE_CHECKING:  # the plain mode registers without loading libllama
    from .sequence import Sequence


def generate_plain(seq: Sequence, prompt: list[int], pick: Picker) -> Iterator[Step]:
    """Yield tokens forever (the stream wrapper stops it). Each step's timings are the time
    spent producing that token: the prefill for the first, one decode for the others.
    ``pick`` (sampling.make_picker) reads the next token: greedy needs no logits copy."""
    t0 = time.perf_counter()
    seq.prefill(prompt, read=False)
    timings = {"prefill": time.perf_counter() - t0}
    while True:
        token = pick(seq)
        yield Step(token=token, timings=timings)
        # The token is decoded only when the next one is asked for, so a stopped
        # generation never pays for a decode it does not use.
        t0 = time.perf_counter()
        seq.decode([token])
        timings = {"decode": time.perf_counter() - t0}


class Plain(Mode):
    """The reference every other mode is measured (and, if lossless, checked) against."""

    name = "plain"
    help = "one target decode per token"
    takes_prediction = True
    runs_in_slots = True

    def start(self, llm, sampling, opts):
        pick = make_picker(sampling)

        def run(tokens, max_new, prediction=None):
            if prediction:
                return with_note(predicted_loop(llm, tokens, prediction, sampling, max_new),
                                 "plain, with drafts from the prediction")
            return generate_plain(llm.tgt.seq, tokens, pick)

        return run


PLAIN = register(Plain())

"""What the modes below the speculative package run with a caller's predicted output
(OpenAI's ``prediction``).

Drafting from a prediction is the speculative package's work, a layer above the engine and
beside early exit: it hands its two pieces over when it loads (:func:`provided_by`). Plain
decoding with a prediction runs its loop (``loop(llm, prompt, prediction, sampling, most new
tokens) -> steps``); early exit drafts from its drafter (``drafter(llm, prediction,
sampling)``, speculative/context_drafter.ContextSource over the prediction alone) between
its own steps.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

from ..errors import SpeceeError
from .steps import Step


class PredictionDrafter(Protocol):
    """The part of the context drafter a loop of its own drives (speculative/decode.py's
    SpecLoop calls the same)."""

    source: str

    def extend(self, tokens, emitted: bool = False) -> None: ...

    def output_began(self, token: int) -> None: ...

    def plan(self, n_context: int, room: int | None = None) -> list[int]: ...

    def update(self, n_drafted: int, n_accept: int, seconds: float = 0.0) -> None: ...

    def plain_step(self, seconds: float) -> None: ...


_loop: Callable[..., Iterator[Step]] | None = None
_drafter: Callable[..., PredictionDrafter] | None = None


def provided_by(loop: Callable[..., Iterator[Step]],
                drafter: Callable[..., PredictionDrafter]) -> None:
    global _loop, _drafter
    _loop, _drafter = loop, drafter


def _missing() -> SpeceeError:
    return SpeceeError("prediction: drafting from one needs the speculative package (import "
                       "specee_cpp)")


def predicted_loop(llm, prompt: list[int], prediction: list[int], sampling,
                   max_new: int) -> Iterator[Step]:
    """Plain decoding that drafts from ``prediction`` where the output follows it."""
    if _loop is None:
        raise _missing()
    return _loop(llm, prompt, prediction, sampling, max_new)


def prediction_drafter(llm, prediction: list[int], sampling) -> PredictionDrafter:
    """A free drafter over ``prediction`` alone, priced as plain decoding's is."""
    if _drafter is None:
        raise _missing()
    return _drafter(llm, prediction, sampling)

"""Decoding modes, registered by name: the one place the CLI, the Python API and the
benchmark look a mode up.

A mode is one small object: its typed options (a frozen dataclass whose defaults are the
mode's defaults), whether it needs a draft model and keeps plain's greedy output, and
``start``, which checks everything that can fail (missing draft, missing bundle, bad
option) and returns the step generator to run on the prompt's tokens. Whatever a mode
derives from the loaded models once (a predictor bundle, a cost model) it keeps with
``LLM.cached``, so the LLM itself knows nothing about any mode.

A new mode is one module: a ``Mode`` subclass and ``register(MyMode())`` at its end; the
built-in ones are imported in one place, ``specee_cpp/__init__.py`` (docs/ARCHITECTURE.md).
This module imports nothing heavy: registering a mode must not load libllama.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

from ..errors import SpeceeError

if TYPE_CHECKING:
    from ..config import SamplingConfig
    from .llm import LLM
    from .steps import Step

# (prompt tokens, most new tokens) -> steps; the limit lets a drafting mode keep its drafts
# within what will be emitted (verifying a token past it is time thrown away). A mode that
# takes a prediction (``Mode.takes_prediction``) is also called with ``prediction=`` the
# caller's predicted output's token ids.
Start = Callable[..., Iterator["Step"]]


def no_status(text: str):
    """``Mode.prepare``'s default status: says nothing."""
    return nullcontext()


@dataclass(frozen=True)
class NoOptions:
    """Options of a mode that has none."""


class Mode:
    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    needs_draft: ClassVar[bool] = False
    lossless: ClassVar[bool] = True      # greedy output equals plain decoding's
    # decodes greedily only (early exit picks a token at an exit layer: no distribution to
    # sample from that is the model's)
    greedy_only: ClassVar[bool] = False
    # drafts from the caller's predicted output (OpenAI's ``prediction``), verified as any
    # draft: the lossless modes
    takes_prediction: ClassVar[bool] = False
    # runs in a slot of a server decoding several requests at once (engine/slots.py), whose
    # decodes share each step's batch with the other slots': not a staged decode
    runs_in_slots: ClassVar[bool] = False
    help: ClassVar[str] = ""

    def options(self, **given: Any):
        """Typed options from keyword values; a name this mode does not take is an error
        (a silently ignored option misleads)."""
        known = [f.name for f in fields(self.Options)]
        for key in given:
            if key not in known:
                raise SpeceeError(f"option {key!r} does not apply to mode {self.name} "
                                  f"(its options: {', '.join(known) or 'none'})")
        return self.Options(**given)

    def needs_draft_in(self, slot: bool) -> bool:
        """Whether this mode needs a draft model, run alone or (``slot``) in a slot of a
        server decoding several requests at once."""
        return self.needs_draft

    def refused_with_slots(self, n: int, opts=None, draft: bool = False) -> str | None:
        """Why this mode (with ``opts``, where given) is not served with ``n`` slots decoding
        at once, ``draft`` saying whether they run a draft model (None: it is)."""
        if n > 1 and not self.runs_in_slots:
            return (f"mode {self.name} is not served with --parallel {n} (its staged decode "
                    f"runs one batch layer by layer)")
        return None

    def refuses_prediction(self) -> str | None:
        """Why this mode takes no predicted output (None: it does)."""
        if self.takes_prediction:
            return None
        takers = [name for name, mode in _MODES.items() if mode.takes_prediction]
        return (f"mode {self.name} does not take one (it does not verify drafts into plain "
                f"decoding's output); the modes that do: {', '.join(takers)}")

    def check(self, llm: LLM, sampling: SamplingConfig) -> None:
        """What every mode's ``start`` would check first: a draft model where the mode needs
        one, greedy decoding where it decodes nothing else. Raised with the offending value."""
        if self.needs_draft_in(in_a_slot(llm)) and llm.draft_path is None:
            raise SpeceeError(f"mode {self.name} needs a draft model (--draft)")
        if self.greedy_only and not sampling.greedy:
            raise SpeceeError(f"mode {self.name} decodes greedily (early exit changes the "
                              f"distribution); got temperature {sampling.temperature}")

    def start(self, llm: LLM, sampling: SamplingConfig, opts) -> Start:
        """The step generator for ``opts``, after ``check``: everything that can fail fails
        here, before any decoding."""
        raise NotImplementedError

    def prepare(self, llm: LLM, opts, status: Callable[[str], Any] = no_status) -> None:
        """Do up front, inside ``status(text)`` (a context manager: the CLI's status line),
        the one-time work the first ``start`` would otherwise do silently (a measurement
        of this machine, say). Nothing by default."""

    def describe(self, opts) -> str:
        """How a benchmark table names this mode with these options."""
        changed = [f"{f.name} {getattr(opts, f.name)}" for f in fields(opts)
                   if getattr(opts, f.name) != f.default]
        return " ".join([f"specee-cpp --mode {self.name}", *changed])


def in_a_slot(llm) -> bool:
    """Whether ``llm`` is a slot of a server decoding several requests at once
    (engine/slots.py)."""
    return getattr(llm, "shares_steps", False)


_MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    if mode.name in _MODES and type(_MODES[mode.name]) is not type(mode):
        raise SpeceeError(f"mode {mode.name!r} is already registered by "
                          f"{type(_MODES[mode.name]).__module__}")
    _MODES[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Remove a mode (a plug-in that is unloaded, a test's mode)."""
    _MODES.pop(name, None)


def get(name: str) -> Mode:
    try:
        return _MODES[name]
    except KeyError:
        raise SpeceeError(f"unknown mode {name!r}; modes: {', '.join(_MODES)}") from None


def names() -> list[str]:
    return list(_MODES)

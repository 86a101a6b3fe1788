"""The x86 kernels' weight read-ahead (patch 0013), on only where it was measured to pay on
this machine.

The patch asks for each weight block a few KiB before the kernel reads it, because the
hardware prefetchers stop at every 4 KiB page. Whether that helps depends on the CPU: it
made a plain token 8-19% cheaper on the Zen 3 and Zen 5 machines it was tuned on and about
9% dearer on a Zen 4 (docs/kernels.md). So the library starts with it off, upstream's
behaviour, and the first load of a model on a machine times one-token decodes with it on
and off, in turn (a second or two), keeps the faster, and caches the choice beside the cost
tables. Chat and a server of one request at a time load without waiting for that timing
(``measure=False``): they run with the read-ahead off and take the timing in slices of idle
time (:class:`IdleReadAhead`), so a new machine's first answer is as quick as any other's;
what has no idle time, or times decodes that must run as later ones will, takes it first
(:func:`settle`). ``SPECEE_CPP_READ_AHEAD`` set by hand wins over all.
"""
from __future__ import annotations

import time
from typing import Callable

from ..config import READ_AHEAD_BYTES, READ_AHEAD_MARGIN
from .timing import (Steps, measured_here, restoring, run_steps, store_timing,
                     time_in_turn_steps, timing_cached, timing_tokens)

VERSION = 1   # part of the cache key: a changed method measures again
PREFIX = "read-ahead"
# why the read-ahead is off in a process that loaded its model without timing it
NOT_YET = "not measured on this machine yet: off until it is, in idle time"


def time_read_ahead_steps(model, n_threads: int, tokens: list[int], distance: int,
                          decodes: int = 16, warmup: int = 2, clock=time.perf_counter) -> Steps:
    """Median seconds of one decoded token of ``model`` with the read-ahead at ``distance``
    bytes and off, after ``tokens`` in the cache, alternating token by token (a machine
    slowing down slows both), each first in turn: {"on": s, "off": s, "distance": bytes}.
    Taken a decode at a time; between two steps the read-ahead is as it was before, so
    whatever decodes meanwhile (a reply) runs as it would have."""
    from ..bindings import Batch, Context, kernel_switch, set_kernel_switch

    before = kernel_switch("READ_AHEAD")
    n = len(tokens)
    ctx = Context(model, n_ctx=n + 8, n_batch=max(n, 1), n_threads=n_threads)
    batch = Batch(max(n, 1))
    try:
        batch.set(tokens, 0)
        ctx.decode(batch)
        yield "the timing's prompt"
        # one context, the setting switched before each decode; each goes first half the time
        steps = time_in_turn_steps({"on": (ctx, lambda: set_kernel_switch("READ_AHEAD", distance)),
                                    "off": (ctx, lambda: set_kernel_switch("READ_AHEAD", 0))},
                                   batch, tokens, n, decodes, warmup, swap=True, clock=clock)
        seen = yield from restoring(steps, "READ_AHEAD", before)
    finally:
        set_kernel_switch("READ_AHEAD", before)
        ctx.close()
        batch.close()
    return {**seen, "distance": distance}


def choose(seen: dict) -> int:
    """The distance to run with: the one timed where it beat off by more than
    READ_AHEAD_MARGIN, else 0 (off: upstream's behaviour, safe where the gain is noise)."""
    return seen["distance"] if seen["on"] < (1.0 - READ_AHEAD_MARGIN) * seen["off"] else 0


def measured() -> list[tuple[str, bool, float, float]]:
    """What was measured on this machine, at any thread count: (model, with its thread
    count where not the default; on?; seconds a token on; off) each."""
    out = []
    for name, seen in measured_here(PREFIX, VERSION):
        try:
            out.append((name, choose(seen) > 0, seen["on"], seen["off"]))
        except (KeyError, TypeError):
            continue
    return out


def _fits(seen: dict) -> bool:
    return {"on", "off", "distance"} <= set(seen)


def read_ahead(llm, measure: bool = True) -> tuple[int | None, str]:
    """Set the read-ahead for this process from this machine's measurement for ``llm``'s
    target (made now if there is none, then cached; with ``measure`` False left for
    :class:`IdleReadAhead`, off until then): (distance in bytes, where it came from). (None,
    why) where the library has no read-ahead, (the value, why) where the environment sets it
    (then machine() records it, and nothing is measured)."""
    from ..bindings import kernel_switch, set_kernel_switch
    from ..provenance import SWITCH_ENV, switch_set

    if switch_set("READ_AHEAD") is not None:
        return switch_set("READ_AHEAD"), f"{SWITCH_ENV.format('READ_AHEAD')} in the environment"
    if kernel_switch("READ_AHEAD") is None:
        return None, "not in this library (patches 0013 and 0014, x86 CPU backend)"
    if llm.config.n_gpu_layers:
        return 0, "off: the weights are on the GPU"
    hit = timing_cached(llm, PREFIX, VERSION, _fits)
    if hit is not None:
        return _apply(*hit)
    if not measure:
        set_kernel_switch("READ_AHEAD", 0)
        return 0, NOT_YET
    return run_steps(read_ahead_steps(llm))


def settle(llm) -> None:
    """Time the read-ahead now where ``llm``'s load left it to idle time: before a timing
    whose decodes must run as the later ones will (a step of several slots against one
    token), or for a run that has no idle time (the slots of a server)."""
    if llm.read_ahead[1] == NOT_YET:
        llm.read_ahead = run_steps(read_ahead_steps(llm))


def read_ahead_steps(llm) -> Steps:
    """The read-ahead's timing for ``llm``'s target taken a decode at a time, then cached
    and applied: returns what :func:`read_ahead` returns."""
    seen = yield from time_read_ahead_steps(llm.model, llm.config.threads, timing_tokens(llm),
                                            READ_AHEAD_BYTES)
    store_timing(llm, PREFIX, VERSION, seen)
    return _apply(seen, "measured on this machine now")


def _apply(seen: dict, source: str) -> tuple[int, str]:
    from ..bindings import set_kernel_switch

    distance = choose(seen)
    set_kernel_switch("READ_AHEAD", distance)
    return distance, (f"{source}: a token {1e3 * seen['on']:.2f} ms with it, "
                      f"{1e3 * seen['off']:.2f} ms without")


class IdleReadAhead:
    """The read-ahead's timing of a model loaded without it (``read_ahead(measure=False)``),
    taken in slices of idle time, one decode each (milliseconds), about 40 in all."""

    def __init__(self, llm, log: Callable[[str], None] | None = None):
        self.llm = llm
        self.log = log or (lambda line: None)
        self._steps: Steps | None = None
        self.error: str | None = None

    def pending(self) -> bool:
        return self.error is None and self.llm.read_ahead[1] == NOT_YET

    def run(self, stop: Callable[[], bool]) -> bool:
        """Take slices until ``stop()`` or the timing is done (True: then it is cached and
        in use). A failure is said once and leaves the read-ahead off."""
        if not self.pending():
            return True
        if self._steps is None:
            self._steps = read_ahead_steps(self.llm)
        try:
            while not stop():
                next(self._steps)
        except StopIteration as done:
            self.llm.read_ahead = done.value
            self._steps = None
            self.log(f"weight read-ahead {'on' if done.value[0] else 'off'} for "
                     f"{self.llm.model.path.name}, {done.value[1]}")
            return True
        except Exception as e:   # noqa: BLE001 - a measurement must not end the session
            self.error = f"{type(e).__name__}: {e}"
            self._steps = None
            self.log(f"timing the weight read-ahead failed ({self.error}); it stays off")
        return False

    def close(self) -> None:
        """Stop a timing in progress (its context is freed before the model is)."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None

"""The kernel choices of a one-token decode on x86, on only where they were measured to pay
on this machine: the rows kernel for a single row of repacked Q4_K (``ONE_ROW``, patch 0015)
and the weights' read-ahead (``READ_AHEAD``, patch 0013).

Neither changes a result; both change the speed of every plain token, and not the same way
on every CPU. The read-ahead asks for each weight block a few KiB before the kernel reads
it, because the hardware prefetchers stop at every 4 KiB page: a plain token 8-19% cheaper
on the Zen 3 and Zen 5 machines it was tuned on, about 9% dearer on a Zen 4. The rows kernel
walks the repacked Q4_K weights two column strips at a time on AVX-512 where upstream's
one-row kernel takes 256-bit steps (a token 0.88x the time on the AMX Xeon with AMX off);
kernels rank differently across CPUs (docs/kernels.md). So the library starts with both
off, upstream's behaviour, and the first load of a model on a machine times one-token
decodes with each on and off, in turn (a second or two each): the one-row kernel first, then
the read-ahead over the kernel chosen; keeps each where it was faster, and caches the
choices beside the cost tables. Chat and a server of one request at a time load without
waiting for that timing (``measure=False``): they run with both off and take the timing in
slices of idle time (:class:`IdleDecodeKernels`), so a new machine's first answer is as
quick as any other's; what has no idle time, or times decodes that must run as later ones
will, takes it first (:func:`settle`). ``SPECEE_CPP_<switch>`` set by hand wins over all:
that switch is not timed.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

from ..config import DECODE_KERNEL_MARGIN, READ_AHEAD_BYTES
from .timing import (Steps, measured_here, restoring, run_steps, store_timing,
                     time_in_turn_steps, timing_cached, timing_tokens)

VERSION = 1   # part of the cache key: a changed method measures again
PREFIX = "decode-kernels"
# the switches timed, in order, each with the value that turns it on; each is timed with
# those before it as chosen
SWITCHES = {"ONE_ROW": 1, "READ_AHEAD": READ_AHEAD_BYTES}
# why the switches are off in a process that loaded its model without timing them
NOT_YET = "not measured on this machine yet: off until they are, in idle time"


class DecodeKernels(NamedTuple):
    """The switches as this process runs them ({name: value}; a switch the library lacks is
    left out) and where that came from."""
    values: dict[str, int]
    source: str

    def key(self) -> list[str]:
        """NAME=value each, for the keys of what was measured with them."""
        return [f"{name}={v}" for name, v in self.values.items()]


def time_switch_steps(model, n_threads: int, tokens: list[int], switch: str, value: int,
                      decodes: int = 16, warmup: int = 2, clock=time.perf_counter) -> Steps:
    """Median seconds of one decoded token of ``model`` with kernel switch ``switch`` at
    ``value`` and at 0, after ``tokens`` in the cache, alternating token by token (a machine
    slowing down slows both), each first in turn: {"on": s, "off": s, "value": value}.
    Taken a decode at a time; between two steps the switch is as it was before, so whatever
    decodes meanwhile (a reply) runs as it would have."""
    from ..bindings import Batch, Context, kernel_switch, set_kernel_switch

    before = kernel_switch(switch)
    n = len(tokens)
    ctx = Context(model, n_ctx=n + 8, n_batch=max(n, 1), n_threads=n_threads)
    batch = Batch(max(n, 1))
    try:
        batch.set(tokens, 0)
        ctx.decode(batch)
        yield "the timing's prompt"
        # one context, the setting switched before each decode; each goes first half the time
        steps = time_in_turn_steps({"on": (ctx, lambda: set_kernel_switch(switch, value)),
                                    "off": (ctx, lambda: set_kernel_switch(switch, 0))},
                                   batch, tokens, n, decodes, warmup, swap=True, clock=clock)
        seen = yield from restoring(steps, switch, before, f"{switch}: ")
    finally:
        set_kernel_switch(switch, before)
        ctx.close()
        batch.close()
    return {**seen, "value": value}


def choose(seen: dict) -> int:
    """The value to run a switch at from its timing: the one timed where it beat off by more
    than DECODE_KERNEL_MARGIN, else 0 (off: upstream's, safe where the gain is noise)."""
    return seen["value"] if seen["on"] < (1.0 - DECODE_KERNEL_MARGIN) * seen["off"] else 0


def measured() -> list[tuple[str, str, bool, float, float]]:
    """What was measured on this machine, at any thread count: (model, with its thread
    count where not the default; switch; on?; seconds a token on; off) each."""
    out = []
    for name, seen in measured_here(PREFIX, VERSION):
        for switch, timing in seen.items():
            try:
                out.append((name, switch, choose(timing) > 0, timing["on"], timing["off"]))
            except (KeyError, TypeError):
                continue
    return out


def _applicable(llm) -> list[str]:
    """The switches whose kernels decode ``llm``'s target in this build: the read-ahead's
    are every x86 one (AVX2 and up), the one-row kernel is repacked Q4_K's (not AMX's)."""
    from ..bindings import kernel_switch, library_info
    from ..provenance import amx_switched_off
    from .prompt_kernels import candidates

    info = library_info()["system_info"]
    if llm.config.n_gpu_layers or "AVX2 = 1" not in info:
        return []
    repacked = "REPACK_ROWS" in candidates(llm.model.info.weight_types, info,
                                           "AMX_INT8 = 1" in info and not amx_switched_off())
    return [s for s in SWITCHES if kernel_switch(s) is not None and
            (s != "ONE_ROW" or repacked)]


def _timed(llm) -> list[str]:
    """The switches a decode of ``llm``'s target is timed for: those not set by hand."""
    from ..provenance import switch_set

    return [s for s in _applicable(llm) if switch_set(s) is None]


def _holds(timed: list[str]) -> Callable[[dict], bool]:
    """Whether a cached timing holds every switch of ``timed``."""
    return lambda seen: all(isinstance(seen.get(s), dict) and {"on", "off", "value"} <= set(seen[s])
                            for s in timed)


def decode_kernels(llm, measure: bool = True) -> DecodeKernels:
    """Set the decode kernels for this process from this machine's measurement for
    ``llm``'s target (made now if there is none, then cached; with ``measure`` False left
    for :class:`IdleDecodeKernels`, off until then). A switch set in the environment keeps
    its value and is not timed; one the library lacks is left out."""
    from ..bindings import kernel_switch, set_kernel_switch

    if all(kernel_switch(s) is None for s in SWITCHES):
        return DecodeKernels({}, "not in this library (patches 0013-0015, x86 CPU backend)")
    if llm.config.n_gpu_layers:
        return _apply({}, "off: the weights are on the GPU")   # the library's default
    if not _applicable(llm):
        return _apply({}, "off: no x86 AVX2 kernel decodes this model here")
    timed = _timed(llm)
    if not timed:
        return _apply({}, "set in the environment")
    hit = timing_cached(llm, PREFIX, VERSION, _holds(timed))
    if hit is not None:
        return _apply({s: hit[0][s] for s in timed}, hit[1])
    if not measure:
        for s in timed:
            set_kernel_switch(s, 0)
        return _apply({}, NOT_YET)
    return run_steps(decode_kernel_steps(llm))


def settle(llm) -> None:
    """Time the decode kernels now where ``llm``'s load left them to idle time: before a
    timing whose decodes must run as the later ones will (a step of several slots against
    one token), or for a run that has no idle time (the slots of a server)."""
    if llm.decode_kernels.source == NOT_YET:
        llm.decode_kernels = run_steps(decode_kernel_steps(llm))


def decode_kernel_steps(llm) -> Steps:
    """The timing of ``llm``'s target taken a decode at a time, each switch after those
    before it are chosen (and set), then cached and applied: returns what
    :func:`decode_kernels` returns."""
    from ..bindings import set_kernel_switch

    seen: dict = {}
    try:
        for switch in _timed(llm):
            seen[switch] = yield from time_switch_steps(llm.model, llm.config.threads,
                                                        timing_tokens(llm), switch,
                                                        SWITCHES[switch])
            set_kernel_switch(switch, choose(seen[switch]))
    except BaseException:   # stopped or failed half-way: all off again, as before it began
        for switch in seen:
            set_kernel_switch(switch, 0)
        raise
    store_timing(llm, PREFIX, VERSION, seen)
    return _apply(seen, "measured on this machine now")


def _apply(seen: dict, source: str) -> DecodeKernels:
    """Set each timed switch as its timing says (off where there is none yet); every switch
    of the library with its value, and where that came from, each timed one's figures."""
    from ..bindings import kernel_switch, set_kernel_switch

    for switch, timing in seen.items():
        set_kernel_switch(switch, choose(timing))
    values = {s: kernel_switch(s) for s in SWITCHES if kernel_switch(s) is not None}
    figures = "; ".join(f"{s} {'on' if choose(t) else 'off'} (a token {1e3 * t['on']:.2f} ms "
                        f"with it, {1e3 * t['off']:.2f} ms without)" for s, t in seen.items())
    return DecodeKernels(values, f"{source}: {figures}" if figures else source)


class IdleDecodeKernels:
    """The decode kernels' timing of a model loaded without it (``decode_kernels(measure=
    False)``), taken in slices of idle time, one decode each (milliseconds), about 40 a
    switch."""

    def __init__(self, llm, log: Callable[[str], None] | None = None):
        self.llm = llm
        self.log = log or (lambda line: None)
        self._steps: Steps | None = None
        self.error: str | None = None

    def pending(self) -> bool:
        return self.error is None and self.llm.decode_kernels.source == NOT_YET

    def run(self, stop: Callable[[], bool]) -> bool:
        """Take slices until ``stop()`` or the timing is done (True: then it is cached and
        in use). A failure is said once and leaves the switches off."""
        if not self.pending():
            return True
        if self._steps is None:
            self._steps = decode_kernel_steps(self.llm)
        try:
            while not stop():
                next(self._steps)
        except StopIteration as done:
            self.llm.decode_kernels = done.value
            self._steps = None
            self.log(f"decode kernels for {self.llm.model.path.name}: {done.value.source}")
            return True
        except Exception as e:   # noqa: BLE001 - a measurement must not end the session
            self.error = f"{type(e).__name__}: {e}"
            self._steps = None
            self.log(f"timing the decode kernels failed ({self.error}); they stay off")
        return False

    def close(self) -> None:
        """Stop a timing in progress (its context is freed before the model is)."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None

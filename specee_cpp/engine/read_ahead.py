"""The x86 kernels' weight read-ahead (patch 0013), on only where it was measured to pay on
this machine.

The patch asks for each weight block a few KiB before the kernel reads it, because the
hardware prefetchers stop at every 4 KiB page. Whether that helps depends on the CPU: it
made a plain token 8-19% cheaper on the Zen 3 and Zen 5 machines it was tuned on and about
9% dearer on a Zen 4 (docs/kernels.md). So the library starts with it off, upstream's
behaviour, and the first load of a model on a machine times one-token decodes with it on
and off, in turn (a second or two), keeps the faster, and caches the choice beside the cost
tables. ``SPECEE_CPP_READ_AHEAD`` set by hand wins over both.
"""
from __future__ import annotations

import time

from ..config import READ_AHEAD_BYTES, READ_AHEAD_MARGIN
from .timing import cached_timing, measured_here, time_in_turn

VERSION = 1   # part of the cache key: a changed method measures again


def time_read_ahead(model, n_threads: int, tokens: list[int], distance: int,
                    decodes: int = 16, warmup: int = 2, clock=time.perf_counter) -> dict:
    """Median seconds of one decoded token of ``model`` with the read-ahead at ``distance``
    bytes and off, after ``tokens`` in the cache, alternating token by token (a machine
    slowing down slows both), each first in turn: {"on": s, "off": s, "distance": bytes}."""
    from ..bindings import Batch, Context, kernel_switch, set_kernel_switch

    before = kernel_switch("READ_AHEAD")
    n = len(tokens)
    ctx = Context(model, n_ctx=n + 8, n_batch=max(n, 1), n_threads=n_threads)
    batch = Batch(max(n, 1))
    try:
        batch.set(tokens, 0)
        ctx.decode(batch)
        # one context, the setting switched before each decode; each goes first half the time
        seen = time_in_turn({"on": (ctx, lambda: set_kernel_switch("READ_AHEAD", distance)),
                             "off": (ctx, lambda: set_kernel_switch("READ_AHEAD", 0))},
                            batch, tokens, n, decodes, warmup, swap=True, clock=clock)
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
    for name, seen in measured_here("read-ahead", VERSION):
        try:
            out.append((name, choose(seen) > 0, seen["on"], seen["off"]))
        except (KeyError, TypeError):
            continue
    return out


def read_ahead(llm) -> tuple[int | None, str]:
    """Set the read-ahead for this process from this machine's measurement for ``llm``'s
    target (made now if there is none, then cached): (distance in bytes, where it came
    from). (None, why) where the library has no read-ahead, (the value, why) where the
    environment sets it (then machine() records it, and nothing is measured)."""
    from ..bindings import kernel_switch, set_kernel_switch
    from ..provenance import SWITCH_ENV, switch_set

    if switch_set("READ_AHEAD") is not None:
        return switch_set("READ_AHEAD"), f"{SWITCH_ENV.format('READ_AHEAD')} in the environment"
    if kernel_switch("READ_AHEAD") is None:
        return None, "not in this library (patches 0013 and 0014, x86 CPU backend)"
    if llm.config.n_gpu_layers:
        return 0, "off: the weights are on the GPU"
    seen, source = cached_timing(
        llm, "read-ahead", VERSION, lambda seen: {"on", "off", "distance"} <= set(seen),
        lambda tokens: time_read_ahead(llm.model, llm.config.threads, tokens, READ_AHEAD_BYTES))
    distance = choose(seen)
    set_kernel_switch("READ_AHEAD", distance)
    return distance, (f"{source}: a token {1e3 * seen['on']:.2f} ms with it, "
                      f"{1e3 * seen['off']:.2f} ms without")

"""How much a step of several requests' tokens costs against a step of one, on this machine.

Slots pay by batching: a step of several requests' tokens costs less than as many steps of
one, by how much depends on the machine (on a 2-core Zen 4 a step of 4 rows cost about two
one-token steps, less where a machine's batches are flatter). The first start of a server on
a model on a machine times one-token decodes against steps of ``SLOT_DEFAULT`` rows, in turn
(a second or two), and caches the timing beside the cost tables; ``server/slot_count.py``
decides with it.
"""
from __future__ import annotations

import time

from ..config import SLOT_DEFAULT, SLOT_GAIN
from .decode_kernels import settle
from .timing import cached_timing, measured_here, time_calls

VERSION = 1   # part of the cache key: a changed method measures again


def time_step(model, n_threads: int, tokens: list[int], rows: int = SLOT_DEFAULT,
              rounds: int = 8, clock=time.perf_counter) -> dict:
    """Median seconds of a one-token decode and of a step of ``rows`` tokens (each with its
    logits, as slots' rows are), after ``tokens`` in the cache, taking turns:
    {"one": s, "step": s, "rows": rows}."""
    from ..bindings import Batch, Context

    n = len(tokens)
    ctx = Context(model, n_ctx=n + rows + 8, n_batch=max(n, rows), n_threads=n_threads)
    batch = Batch(max(n, rows))
    try:
        batch.set(tokens, 0)
        ctx.decode(batch)

        def decode(k: int):
            def run():
                batch.set(tokens[:k], n, output_last_only=False)
                ctx.decode(batch)
            return run, lambda: ctx.seq_rm(n)

        seen = time_calls({"one": decode(1), "step": decode(rows)}, rounds, warmup=2,
                          clock=clock)
    finally:
        ctx.close()
        batch.close()
    return {**seen, "rows": rows}


def gain(seen: dict) -> float:
    """Tokens a second of a step of ``seen["rows"]`` requests over one request at a time."""
    return seen["rows"] * seen["one"] / seen["step"]


def pays(seen: dict) -> bool:
    """Whether that gain is worth slots' KV caches and a full step's slower tokens."""
    return gain(seen) >= SLOT_GAIN


def measured() -> list[tuple[str, int, float]]:
    """What was measured on this machine, at any thread count: (model, with its thread count
    where not the default; the slots serve defaults to by it; the step's gain) each."""
    out = []
    for name, seen in measured_here("slot-step", VERSION):
        try:
            g = gain(seen)
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        out.append((name, SLOT_DEFAULT if pays(seen) else 1, g))
    return out


def step_timing(llm) -> tuple[dict, str]:
    """This machine's timing for the target (cached, else measured now and cached), and where
    it came from."""
    def measure(tokens: list[int]) -> dict:
        settle(llm)   # the step and the one token decode as a server's will, kernels too
        return time_step(llm.model, llm.config.threads, tokens)

    return cached_timing(
        llm, "slot-step", VERSION,
        lambda seen: {"one", "step", "rows"} <= set(seen) and seen["rows"] == SLOT_DEFAULT,
        measure)

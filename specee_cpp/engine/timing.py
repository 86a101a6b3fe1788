"""One-token decodes timed in turn: how the engine's per-machine choices (the draft's flash
attention, the weights' read-ahead) compare two ways of decoding on the machine at hand."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def time_in_turn(runs: dict, batch, tokens: list[int], pos: int, decodes: int,
                 warmup: int = 2, swap: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds of one token decoded at ``pos`` in each of ``runs`` ({name: (context,
    what to set before each of its decodes, or None)}), the runs taking turns token by token
    (a machine slowing down slows them all); each decode is removed again, so all see the
    same cache. ``swap``: the order reverses every other token, so that none always goes
    first. ``warmup`` turns are not counted."""
    order = list(runs.items())
    times: dict = {name: [] for name in runs}
    for i in range(warmup + decodes):
        for name, (ctx, before) in (order[::-1] if swap and i % 2 == 0 else order):
            if before is not None:
                before()
            batch.set([tokens[i % len(tokens)]], pos)
            t0 = clock()
            ctx.decode(batch)
            dt = clock() - t0
            ctx.seq_rm(pos)
            if i >= warmup:
                times[name].append(dt)
    return {name: float(np.median(t)) for name, t in times.items()}

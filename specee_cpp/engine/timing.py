"""Decodes timed in turn: how the engine's per-machine choices (the draft's flash attention,
the weights' read-ahead, the kernels that read a prompt) compare two ways of decoding on the
machine at hand."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Generator, Iterator

import numpy as np

# a measurement taken one decode at a time: yields what it did after each, returns its result
Steps = Generator[str, None, Any]


def run_steps(steps: Steps) -> Any:
    """The result of a step-wise measurement run to its end in one go."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def time_calls(calls: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], rounds: int,
               warmup: int = 1, clock: Callable[[], float] = time.perf_counter
               ) -> dict[str, float]:
    """Median seconds of each of ``calls`` ({name: (run, undo)}), the calls taking turns
    round by round (a machine slowing down slows them all); ``undo``, untimed, puts back
    what ``run`` changed (a decoded token removed from the cache). ``warmup`` rounds first
    are not counted."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(warmup + rounds):
        for name, (run, undo) in calls.items():
            t0 = clock()
            run()
            dt = clock() - t0
            undo()
            if i >= warmup:
                times[name].append(dt)
    return {name: float(np.median(t)) for name, t in times.items()}


def time_in_turn(runs: dict, batch, tokens: list[int], pos: int, decodes: int,
                 warmup: int = 2, swap: bool = False, rows: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """:func:`time_in_turn_steps` in one go."""
    return run_steps(time_in_turn_steps(runs, batch, tokens, pos, decodes, warmup, swap, rows,
                                        clock))


def time_in_turn_steps(runs: dict, batch, tokens: list[int], pos: int, decodes: int,
                       warmup: int = 2, swap: bool = False, rows: int = 1,
                       clock: Callable[[], float] = time.perf_counter) -> Steps:
    """Median seconds of one token (``rows`` > 1: of a batch of that many of ``tokens``)
    decoded at ``pos`` in each of ``runs`` ({name: (context, what to set before each of its
    decodes, or None)}), the runs taking turns decode by decode (a machine slowing down
    slows them all); each decode is removed again, so all see the same cache. ``swap``: the
    order reverses every other turn, so that none always goes first. ``warmup`` turns are
    not counted."""
    order = list(runs.items())
    times: dict = {name: [] for name in runs}
    for i in range(warmup + decodes):
        for name, (ctx, before) in (order[::-1] if swap and i % 2 == 0 else order):
            if before is not None:
                before()
            batch.set(tokens[:rows] if rows > 1 else [tokens[i % len(tokens)]], pos)
            t0 = clock()
            ctx.decode(batch)
            dt = clock() - t0
            ctx.seq_rm(pos)
            if i >= warmup:
                times[name].append(dt)
            yield name
    return {name: float(np.median(t)) for name, t in times.items()}


def restoring(steps: Steps, switch: str, value: int, label: str = "") -> Steps:
    """``steps`` (each of which may set the kernel switch ``switch``) with the switch put back
    to ``value`` after each, so that whatever decodes between two steps runs as it would have;
    each step's name prefixed with ``label``. Returns their result."""
    from ..bindings import set_kernel_switch

    while True:
        try:
            what = next(steps)
        except StopIteration as done:
            return done.value
        set_kernel_switch(switch, value)
        yield label + what


def cache_file(prefix: str, version: int, model_path, where: dict):
    """Where a timing ``prefix`` of a model on a machine (``provenance.machine``) is cached,
    beside the cost tables: the model by name and size (no hash of a GB file at every
    load), in the name :func:`measured_here` reads back."""
    from ..paths import home
    from ..provenance import machine_id

    return home() / "costs" / (f"{prefix}-{model_path.stem[:40]}-{model_path.stat().st_size}"
                               f"-m{machine_id(where)}-v{version}.json")


def timing_file(llm, prefix: str, version: int):
    """Where this machine's timing ``prefix`` of ``llm``'s target is cached."""
    from ..provenance import machine

    return cache_file(prefix, version, llm.model.path, machine(llm.config.threads))


def timing_cached(llm, prefix: str, version: int,
                  fits: Callable[[dict], bool]) -> tuple[dict, str] | None:
    """This machine's cached timing ``prefix`` of ``llm``'s target where there is one and it
    ``fits`` (a dict), with where it came from; else None (none yet, torn or another
    layout)."""
    cache = timing_file(llm, prefix, version)
    try:
        seen = json.loads(cache.read_text(encoding="utf-8"))
        if isinstance(seen, dict) and fits(seen):
            return seen, f"measured on this machine ({cache.name})"
    except (OSError, ValueError, TypeError):
        pass
    return None


def timing_tokens(llm) -> list[int]:
    """The 64 tokens of the cost prompt a timing decodes after."""
    from ..config import COST_PROMPT

    raw = llm.prompt_tokens(COST_PROMPT, chat=False)
    return (raw * (64 // len(raw) + 1))[:64]


def store_timing(llm, prefix: str, version: int, seen: dict) -> None:
    from ..paths import write_text_atomic

    write_text_atomic(timing_file(llm, prefix, version), json.dumps(seen))


def cached_timing(llm, prefix: str, version: int, fits: Callable[[dict], bool],
                  measure: Callable[[list[int]], dict]) -> tuple[dict, str]:
    """This machine's timing ``prefix`` of ``llm``'s target: the cached one where it
    ``fits``, else ``measure`` run now after 64 tokens of the cost prompt, and cached; and
    where it came from."""
    hit = timing_cached(llm, prefix, version, fits)
    if hit is not None:
        return hit
    seen = measure(timing_tokens(llm))
    store_timing(llm, prefix, version, seen)
    return seen, "measured on this machine now"


def measured_here(prefix: str, version: int) -> Iterator[tuple[str, dict]]:
    """The cached timings ``<prefix>-<model>-m<machine>-v<version>.json`` of this machine at
    any thread count, as (model, with its thread count where not the default; the timing).
    Unreadable files are passed over."""
    import os

    from ..config import default_threads
    from ..paths import home
    from ..provenance import machine, machine_id

    for n in range(1, (os.cpu_count() or 1) + 1):
        mid = machine_id(machine(n))
        for f in sorted((home() / "costs").glob(f"{prefix}-*-m{mid}-v{version}.json")):
            try:
                seen = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            name = f.name.split(f"-m{mid}")[0].removeprefix(f"{prefix}-")
            if n != default_threads():
                name += f" ({n} thread{'s' if n > 1 else ''})"
            yield name, seen

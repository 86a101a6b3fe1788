"""Whether the patched row kernels also read prompts on this machine.

The row kernels (patches 0010, 0015, 0016) take the batches a speculative verification
makes, 2 to 64 rows, by default: each of their rows equals that token decoded alone, bit for
bit, which upstream's gemms do not give. Larger batches (a prompt, read n_batch tokens at a
time) keep upstream's kernels until measured: ours beat them at every size on the 2-core
machines they were written on, but split a batch's work into fewer pieces than a many-core
CPU has threads, and upstream's 16-row AVX-512 gemm beat one of them on an Ice Lake Xeon.
So before a cost table is measured (the prices of reading a prompt depend on it), one
prompt batch is timed both ways on this machine for each switch that applies to the target,
in turn, and a switch takes every batch only where ours was faster by more than
PROMPT_KERNEL_MARGIN. The choice is cached per target and machine beside the cost tables and
set again at every later load. A switch set by hand (``SPECEE_CPP_<name>``) is left alone.
"""
from __future__ import annotations

import time

from ..config import COST_PROMPT, PROMPT_KERNEL_MARGIN, PROMPT_KERNEL_ROWS
from .timing import (Steps, measured_here, restoring, run_steps, store_timing,
                     time_in_turn_steps, timing_cached)

VERSION = 1          # part of the cache key: a changed method measures again
PREFIX = "prompt-kernels"
EVERY_BATCH = 1 << 30   # a row limit no batch reaches
# the switches whose kernels may read prompts (the others stop at verification sizes), and
# the weight types each one's kernels take
TAKES = {"AMX_FUSED_ROWS": {"Q4_K", "Q6_K"}, "REPACK_ROWS": {"Q4_K"}, "Q6_K_ROWS": {"Q6_K"}}
PROMPT_SWITCHES = tuple(TAKES)


def build_switches(system_info: str, amx_on: bool) -> list[str]:
    """The x86 row-limit switches whose kernels this build runs (AVX2 and up): AMX's with
    AMX on (its buffer takes the weights), else repacked Q4_K's (where the build repacks,
    patch 0015) and Q6_K's (0016)."""
    if "AVX2 = 1" not in system_info:
        return []
    if amx_on:
        return ["AMX_ROWS", "AMX_FUSED_ROWS"]
    return (["REPACK_ROWS"] if "REPACK = 1" in system_info else []) + ["Q6_K_ROWS"]


def candidates(weight_types: frozenset[str], system_info: str, amx_on: bool) -> list[str]:
    """The switches whose kernels would read this target's prompt batches in this build."""
    return [n for n in build_switches(system_info, amx_on)
            if weight_types & TAKES.get(n, set())]


def time_prompt_kernels(model, n_threads: int, tokens: list[int], name: str, turns: int = 2,
                        warmup: int = 1, clock=time.perf_counter) -> dict:
    """Median seconds of one batch of ``tokens`` read by ``model`` with switch ``name`` at
    every batch ("ours") and as it is ("upstream": the batch is above its limit), in turn:
    {"ours": s, "upstream": s, "rows": n}."""
    return run_steps(time_prompt_kernels_steps(model, n_threads, tokens, name, turns, warmup,
                                               clock))


def time_prompt_kernels_steps(model, n_threads: int, tokens: list[int], name: str,
                              turns: int = 2, warmup: int = 1,
                              clock=time.perf_counter) -> Steps:
    """:func:`time_prompt_kernels` a batch at a time; between steps the switch is as it was
    (the models may decode for someone else there)."""
    from ..bindings import Batch, Context, kernel_switch, set_kernel_switch

    before = kernel_switch(name)
    n = len(tokens)
    ctx = Context(model, n_ctx=n + 8, n_batch=n, n_threads=n_threads)
    batch = Batch(n)
    steps = time_in_turn_steps({"ours": (ctx, lambda: set_kernel_switch(name, EVERY_BATCH)),
                                "upstream": (ctx, lambda: set_kernel_switch(name, before))},
                               batch, tokens, 0, turns, warmup, swap=True, rows=n, clock=clock)
    try:
        seen = yield from restoring(steps, name, before, f"prompt kernels: {name}, ")
    finally:
        set_kernel_switch(name, before)
        ctx.close()
        batch.close()
    return {**seen, "rows": n}


def choose(seen: dict) -> bool:
    """Ours for prompts: only where it beat upstream's by more than the margin (upstream's is
    the safe choice where the difference is noise)."""
    return seen["ours"] < (1.0 - PROMPT_KERNEL_MARGIN) * seen["upstream"]


def prompt_kernels_known(llm) -> bool:
    """Whether the prompt kernels of ``llm``'s target are measured on this machine (or no
    switch applies to it): a cost table keyed by them can be looked up."""
    names = _applies(llm)
    return not names or _measured(llm, names) is not None


def _measured(llm, names: list[str]) -> tuple[dict, str] | None:
    """This machine's cached measurement for ``llm``'s target where it holds every switch
    of ``names``, with where it came from; else None (none yet, torn, or another layout)."""
    return timing_cached(llm, PREFIX, VERSION, lambda seen: all(
        isinstance(seen.get(n), dict) and {"ours", "upstream"} <= set(seen[n]) for n in names))


def _applies(llm) -> list[str]:
    from ..bindings import kernel_switch, library_info
    from ..provenance import amx_switched_off, switch_set

    if llm.config.n_gpu_layers:
        return []
    info = library_info()["system_info"]
    names = candidates(llm.model.info.weight_types, info,
                       "AMX_INT8 = 1" in info and not amx_switched_off())
    return [n for n in names if switch_set(n) is None and kernel_switch(n) is not None]


def prompt_kernels(llm, measure: bool = False, progress=None) -> dict[str, str]:
    """Set the switches that read ``llm``'s prompts from this machine's measurement for its
    target (``measure``: made now where there is none, then cached): {switch: "ours" or
    "upstream's", with where that came from}, empty where no switch applies or none was
    measured yet (then upstream's kernels read prompts)."""
    return run_steps(prompt_kernels_steps(llm, measure, progress))


def prompt_kernels_steps(llm, measure: bool = False, progress=None) -> Steps:
    """:func:`prompt_kernels`, a measurement taken a batch at a time."""
    from ..bindings import set_kernel_switch

    names = _applies(llm)
    if not names:
        return {}
    hit = _measured(llm, names)
    if hit is not None:
        seen, source = hit
    else:
        if not measure:
            return {}
        raw = llm.prompt_tokens(COST_PROMPT, chat=False)
        tokens = (raw * (PROMPT_KERNEL_ROWS // len(raw) + 1))[:PROMPT_KERNEL_ROWS]
        seen = {}
        for name in names:
            if progress is not None:
                progress(f"prompt kernels: {name}, ours and upstream's")
            seen[name] = yield from time_prompt_kernels_steps(llm.model, llm.config.threads,
                                                              tokens, name)
        store_timing(llm, PREFIX, VERSION, seen)
        source = "measured on this machine now"
    out = {}
    for name in names:
        ours = choose(seen[name])
        if ours:
            set_kernel_switch(name, EVERY_BATCH)
        out[name] = (f"{'ours' if ours else 'upstream'} for prompts, {source}: a "
                     f"{seen[name].get('rows', PROMPT_KERNEL_ROWS)}-token batch "
                     f"{seen[name]['ours']:.2f} s ours, {seen[name]['upstream']:.2f} s upstream's")
    return out


def measured() -> list[tuple[str, str, bool, float, float]]:
    """What was measured on this machine at any thread count: (model, with its thread count
    where not the default; switch; ours chosen?; seconds ours; seconds upstream's) each."""
    out = []
    for name, seen in measured_here(PREFIX, VERSION):
        try:
            out += [(name, sw, choose(s), s["ours"], s["upstream"]) for sw, s in seen.items()]
        except (KeyError, TypeError, AttributeError):
            continue
    return out

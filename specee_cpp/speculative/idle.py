"""This machine's cost table, measured where nobody waits on the models.

A speculative run needs the pair's cost table (speculative/cost.py), and measuring it takes
minutes on a 2-core machine. Where the command says so (``LLM.defer_costs``: chat, generate
and serve do), a run on a machine without one answers at once, with plain decoding and the
context drafter at prices safe on any machine (``provisional_costs``), and the measurement
runs in slices of idle time instead: between chat turns while the user types, between the
server's requests. It starts with a first estimate (cost.estimate_steps: a few timed sizes,
seconds), which prices the runs until the table replaces it: the draft model joins at once
where the estimate clearly says it pays. Each slice is one timed decode (a second or two at most: a prompt batch,
a verification of 64 rows); a request waits at most for the slice in flight, except for the
choice of a ``NAME:auto`` variant, one slice (seconds a variant, minutes where one must be
made first). The table's samples are kept on disk after every slice, so a measurement
stopped by the end of a session resumes in the next one where it stopped (the timings that
come before the table, of the prompt kernels and the draft's attention, start again). When
it is complete the table is cached as a foreground measurement's would be, and the next
generation drafts with it (its note says so once). ``specee-cpp costs`` still measures in
the foreground.

The slices run on whichever thread calls ``run``: the server's worker between jobs, a
helper thread of chat while it waits for input, joined before the next reply decodes
(llama.cpp contexts are driven by one thread at a time). The target is measured in a
context of its own, so the conversation's cache is kept; the draft's context is free while
the run is provisional, since only the context drafter drafts then.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

from ..config import COST_PROMPT
from ..errors import SpeceeError
from ..paths import write_text_atomic
from .cost import (cache_path, implausible, steady_table_steps, store, table_from,
                   with_key)


def provisional_costs():
    """The table a run without this machine's uses for the context drafter: the dearest
    verification measured on any machine (speculative/prediction.assumed_costs)."""
    from .cost import as_table
    from .prediction import assumed_costs

    return as_table(assumed_costs())


def partial_path(key: str):
    p = cache_path(key)
    return p.with_name(p.stem + ".partial.json")


class IdleCosts:
    """The measurement of one loaded pair's cost table in slices (``run``)."""

    def __init__(self, llm, log: Callable[[str], None] | None = None):
        self.llm = llm
        self.log = log or (lambda line: None)
        self._steps: Iterator[str] | None = None
        self.done = False
        self.error: str | None = None
        self.announced = False        # the next generation's note said the table is in

    def pending(self) -> bool:
        """Whether there is measuring left to do (and it has not failed): the table of the
        draft that will run and, for ``NAME:auto``, the choice of that draft."""
        from .mode import measured_costs, pair_state
        from .variants import remembered_choice

        if self.done or self.error is not None:
            return False
        state = pair_state(self.llm)
        if self.llm.draft_auto and state.variant_note is None:
            state.variant_note = remembered_choice(self.llm)
            if state.variant_note is None:
                return True
        if measured_costs(self.llm) is not None:
            self.done = True
            # found before this process measured anything: no note is to say it was
            self.announced = self.announced or self._steps is None
            return False
        return True

    def run(self, stop: Callable[[], bool]) -> bool:
        """Take slices until ``stop()`` says a request is waiting or the table is complete
        (True). A failure is kept in ``error`` (said once in the log) and stops the work:
        runs go on with the provisional costs."""
        if not self.pending():
            return self.done
        if self._steps is None:
            self._steps = self._work()
        try:
            while not stop():
                next(self._steps)
        except StopIteration:
            self.done = True
        except Exception as e:   # noqa: BLE001 - a measurement must not end the session
            self.error = f"{type(e).__name__}: {e}"
            self.log(f"measuring this machine's costs failed ({self.error}); drafting stays "
                     f"at the provisional prices (specee-cpp costs measures in the foreground)")
        return self.done

    def close(self) -> None:
        """Stop a measurement in progress (its context is freed before the models are; the
        samples taken so far are on disk)."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None

    def _work(self) -> Iterator[str]:
        from .mode import choose_variant, estimated_costs, measured_costs, pair_state

        llm = self.llm
        state = pair_state(llm)
        if measured_costs(llm) is None and estimated_costs(llm) is None:
            yield from self._estimate()
        if measured_costs(llm) is None:
            yield from self._table()
        if llm.draft_auto and state.variant_note is None:
            # the variants are timed against the shipped draft in one slice (seconds each
            # where they exist; made first where not, once per machine)
            self.log(f"choosing this machine's variant of {llm.draft_auto}")
            choose_variant(llm, lambda text: _Quiet())
            yield "the draft variant"
            if measured_costs(llm) is None:   # the variant chosen has a table of its own
                yield from self._table()

    def _estimate(self) -> Iterator[str]:
        """The first estimate (cost.estimate_steps): seconds, not kept half-taken."""
        from .cost import estimate_steps, model_from
        from .mode import estimate_key, estimate_verdict, pair_state

        llm = self.llm
        self.log(f"estimating this machine's draft/verify costs for {llm.draft_path.name} "
                 f"while idle (a few seconds; the full measurement follows)")
        state: dict = {}
        with self._target_seq() as seq:
            yield from estimate_steps(seq, llm.dft.seq, llm.prompt_tokens(COST_PROMPT), state)
        estimate = model_from(state)
        busy = implausible(estimate)
        if busy is not None:   # the full measurement, taken again where disturbed, decides
            self.log(f"first estimate disturbed by other work ({busy}); the full measurement "
                     f"follows")
            yield "the first estimate"
            return
        table = store(estimate_key(llm), estimate)
        pair_state(llm).estimate = table
        c = table.points[0]
        self.log(f"first estimate: a draft token {c.draft_token_s / c.plain:.2f} of a target "
                 f"token, verify 2/5/9 rows {c.verify(2) / c.plain:.2f}/"
                 f"{c.verify(5) / c.plain:.2f}/{c.verify(9) / c.plain:.2f} plain tokens: "
                 + {"pays": "the draft model joins now",
                    "loses": "the draft model is not expected to pay here",
                    "near": "too close to call for the draft model"}[estimate_verdict(table)]
                 + "; the full measurement refines it")
        yield "the first estimate"   # a request arriving now is priced by it

    @contextmanager
    def _target_seq(self):
        """A Sequence of the target in a context of its own (the conversation's cache is
        kept); the draft's cache is left empty after."""
        from ..bindings import Context
        from ..engine.sequence import Sequence

        llm = self.llm
        tgt = llm.tgt
        ctx = Context(tgt.model, n_ctx=tgt.ctx.n_ctx, n_batch=llm.config.n_batch,
                      n_threads=llm.config.threads)
        try:
            yield Sequence(ctx)
        finally:
            ctx.close()
            if llm.draft_loaded:
                try:
                    llm.dft.seq.rewind(0)
                except SpeceeError:   # the pair was closed with the measurement paused
                    pass

    def _table(self) -> Iterator[str]:
        from ..engine.draft_attention import draft_attention_steps
        from .mode import cost_key_steps, pair_state
        from .variants import drafting_margin

        llm = self.llm
        t0 = time.perf_counter()
        self.log(f"measuring this machine's draft/verify costs for {llm.draft_path.name} "
                 f"while idle (about 2 minutes of idle time with the default pair on 2 cores, "
                 f"kept across runs)")
        key, where = yield from cost_key_steps(llm, measure=True)
        fa, seen = yield from draft_attention_steps(llm)
        path = partial_path(key)
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError(path)
            self.log(f"resuming the cost measurement ({sum(1 for _ in _samples(state))} "
                     f"samples taken in an earlier run)")
        except (OSError, ValueError):
            state = {}
        with self._target_seq() as seq:
            prompt = llm.prompt_tokens(COST_PROMPT)
            for what in steady_table_steps(seq, llm.dft.seq, prompt, state, drafting_margin):
                write_text_atomic(path, json.dumps(state))
                yield what
        table = with_key(key, replace(table_from(state), machine=where, draft_flash_attn=fa,
                                      draft_attention=seen))
        path.unlink(missing_ok=True)
        busy = implausible(table)
        if busy is None:
            table = store(key, table)
        pair_state(llm).costs = table
        self.log(f"this machine's draft/verify costs are measured ({time.perf_counter() - t0:.0f}"
                 f" s in this run); the next reply drafts with them"
                 + ("" if busy is None else f"; other work disturbed the measurement ({busy}), "
                    f"so it is not kept: the next run measures again"))


class _Quiet:
    """A status line that shows nothing (the slices run while the user types)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _samples(state: dict) -> Iterator[float]:
    for point in state.get("points", []):
        for k, v in point.items():
            if k == "long_sizes":
                continue
            if isinstance(v, list):
                yield from v
            elif isinstance(v, dict):
                for runs in v.values():
                    yield from runs

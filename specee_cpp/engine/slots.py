"""Several generations in one context, their rows decoded in one batch.

Each slot is a sequence of the target's context (``LoadConfig.n_seq``: one KV cache, n_ctx
tokens per slot) driven by its own thread, running a strategy unchanged: the strategy sees a
:class:`SlotLLM` whose target context is a :class:`SlotContext`, a view that hands each
decode's rows to the :class:`SharedDecoder` and waits. The decoder runs one ``llama_decode``,
on a thread of its own, as soon as every slot in use is waiting on it, with the waiting
slots' rows (a decode's whole, a prompt's as far as the step has room), so the slots advance
together, a step of four clients costing about what a small verification batch costs. A
slot's draft and its verification are its own: mode spec drafts from the slot's context and
prediction, and where the server runs a draft model in the slots, from a sequence of the
draft's context that is the slot's, handed to the decoder the same way; a step then decodes
the draft's rows of the slots drafting, then the target's of the others, so that a slot
drafting and one verifying advance together. A step holds at most ``SLOT_STEP`` rows
(config.py says why).
A new prompt's rows go first, so its first token waits on no one's verification (the same
rows are decoded either way, in another order); past ``SLOT_PROMPT_AHEAD`` of them in a row
the others go first for a step, the prompt filling the room they leave, so a long prompt
does not stall them. Prompts that wait together are read in the order they came, each to its
end.

What makes a slot's rows its own: every step is a batch the row kernels take, whose rows
equal the same tokens decoded one at a time, and the cache keeps each slot's cells in a
range of its own, in position order (``Context.keep_sequences_apart``), so attention reads a
slot's keys as a context of its own holds them, whatever the others decode or free. A slot's
answer is therefore the one the same server gives the request when it is alone. Against a
server of one slot it can still part past 64 prompt tokens, at a near tie: a prompt read
alone goes in batches of more than 64 rows, through the kernels measured fastest for
prompts, which round differently from the row kernels. Reading a slot's prompt in such
batches would remove that (and read it faster on some CPUs), but the cells they leave keep
that batch's rounding: a later request that reuses them would answer by the batch an earlier
one was read in, so a slot's answer would depend on what the slot served before.

Between two steps no decode runs: that is when each slot reads its outputs and cuts its
cache, one slot at a time (``SharedDecoder.lock``: llama.cpp's reads and cache edits are not
safe from two threads at once). A step holds the lock too: a slot that has left the steps
(``leave``) and edits its cache then waits for the step in flight instead of racing it.
Only decodes that go through a sequence are batched: the staged decode of early exit runs
one batch layer by layer and is refused in a slot.
"""
from __future__ import annotations

import threading

import numpy as np

from ..bindings import Batch, Context
from ..config import SLOT_PROMPT_AHEAD, SLOT_STEP
from ..errors import SpeceeError
from .llm import LLM
from .sequence import Sequence

# seconds without a slot in use after which the steps' thread ends (a later slot starts one)
STEPPER_IDLE_S = 1.0


class _Lane:
    """One context's side of the steps: its batch, its decodes, and the prompt rows gone
    ahead of its waiting slots since they last had a step."""

    def __init__(self, ctx: Context):
        self.ctx, self.batch = ctx, Batch(ctx.n_batch)
        self.ahead = 0
        self.steps = 0      # llama_decode calls: how the slots were batched


class SharedDecoder:
    """One ``llama_decode`` a step for the rows of every waiting slot of ``ctx``, and where a
    draft model runs in the slots, one of its context ``draft_ctx`` for theirs first."""

    def __init__(self, ctx: Context, max_rows: int = SLOT_STEP,
                 prompt_ahead: int = SLOT_PROMPT_AHEAD, draft_ctx: Context | None = None):
        self.ctx, self.draft_ctx = ctx, draft_ctx
        self._target = _Lane(ctx)
        self._draft = _Lane(draft_ctx) if draft_ctx is not None else None
        # the contexts a step decodes, the draft's first: a slot waits on one at a time
        self._lanes = [lane for lane in (self._draft, self._target) if lane is not None]
        self.max_rows = min([max_rows] + [lane.ctx.n_batch for lane in self._lanes])
        self.prompt_ahead = prompt_ahead
        self._cond = threading.Condition()
        self._in_use = 0
        # slot -> (rows, divisible, context), in arrival order
        self._waiting: dict[int, tuple] = {}
        self._reading: dict[int, int] = {}   # slot -> when its prompt came, while read
        self._prompts = 0
        self._done: dict[int, tuple[int, int] | BaseException] = {}
        # held by a slot reading its outputs or cutting its cache between steps
        self.lock = threading.Lock()
        self._stepper: threading.Thread | None = None

    @property
    def steps(self) -> int:
        """The target's llama_decode calls: how the slots were batched."""
        return self._target.steps

    @property
    def draft_steps(self) -> int:
        """The draft's."""
        return self._draft.steps if self._draft is not None else 0

    def enter(self) -> None:
        """A slot starts decoding: the next step waits for its rows too."""
        with self._cond:
            self._in_use += 1
            if self._stepper is None:
                self._stepper = threading.Thread(target=self._run_steps, daemon=True,
                                                 name="specee-cpp-steps")
                self._stepper.start()

    def leave(self, slot: int | None = None) -> None:
        """A slot is done (its cache cut back): the steps no longer wait for it (nor, given
        ``slot``, a prompt of its that was cut short: its next one takes its turn anew)."""
        with self._cond:
            self._in_use -= 1
            self._reading.pop(slot, None)
            self._cond.notify_all()     # the others' step may be ready now

    def _run_steps(self) -> None:
        """The thread every step runs on while slots are in use. One thread, not whichever
        slot completes a step: each thread that runs a decode gets an OpenMP thread team of
        its own, and where their threads outnumber the cores, OpenMP stops spinning at its
        barriers, which slows every decode of the process. It ends once no slot has been in
        use for STEPPER_IDLE_S."""
        with self._cond:
            while True:
                if self._step_if_ready():
                    continue
                if self._in_use:
                    self._cond.wait()
                elif not self._cond.wait(STEPPER_IDLE_S) and not self._in_use:
                    self._stepper = None
                    return

    def decode(self, slot: int, rows: list[tuple[int, int, int, bool]],
               divisible: bool = False, ctx: Context | None = None) -> tuple[int, int]:
        """Decode ``rows`` of (token, position, sequence, logits wanted) in ``ctx`` (the
        target's by default) in the next step; returns where they start in that step's batch
        of ``ctx`` (the outputs are read by that index until the slot asks for its next
        decode) and how many were decoded: all of them, or where ``divisible`` (a prompt's)
        the first ones the step had room for."""
        ctx = self.ctx if ctx is None else ctx
        with self._cond:
            self._waiting[slot] = (rows, divisible, ctx)
            if not divisible:     # its prompt, if any, is read
                self._reading.pop(slot, None)
            elif slot not in self._reading:
                self._reading[slot] = self._prompts
                self._prompts += 1
            self._cond.notify_all()     # the step may be ready now
            while slot not in self._done:
                self._cond.wait()
            done = self._done.pop(slot)
        if isinstance(done, BaseException):
            raise done
        return done

    def _step_if_ready(self) -> bool:
        """With the lock held: one step once every slot in use waits on one (whether it
        ran): the draft's batch of the slots waiting on the draft, then the target's of
        those waiting on the target (a slot drafting and one verifying both advance)."""
        if not self._waiting or len(self._waiting) < self._in_use:
            return False
        for lane in self._lanes:
            waiting = [(s, w) for s, w in self._waiting.items() if w[2] is lane.ctx]
            if waiting:
                self._decode(lane, waiting)
        self._cond.notify_all()
        return True

    def _decode(self, lane: _Lane, waiting: list) -> None:
        """One decode of ``lane``'s context for its waiting slots: each slot's rows whole, a
        prompt's as far as the room left goes; prompts first, until ``prompt_ahead`` of their
        rows went ahead of the others' (then the others first for a step, the prompts
        filling the room they leave)."""
        others = not all(divisible for _, (_, divisible, _) in waiting)
        first = others and lane.ahead < self.prompt_ahead
        # prompts first, or once their turn is over last, the one that came first first (its
        # first token comes as soon as if it were read alone; prompts that took turns would
        # all wait for the last one's rows); else in the order the slots came
        waiting.sort(key=lambda w: (w[1][1] != first, self._reading.get(w[0], 0)))
        taken, rows = [], []
        for slot, (r, divisible, _) in waiting:
            room = self.max_rows - len(rows)
            if room <= 0 or (rows and len(r) > room and not divisible):
                break          # the next step takes it first
            if divisible:
                r = r[:room]
            taken.append((slot, len(rows), len(r)))
            rows += r
        ahead = sum(n for s, _, n in taken if self._waiting[s][1]) if first else 0
        if ahead and len(taken) < len(waiting):
            lane.ahead += ahead
        else:   # the others had a step, none of it behind a prompt: no one waits on one
            lane.ahead = 0
        try:
            lane.batch.set_rows(rows)
            with self.lock:   # a cache edit from a slot no longer in use waits for the step
                lane.ctx.decode(lane.batch)
            lane.steps += 1
            failed = None
        except BaseException as e:    # every slot of the step gets it: the step did not run
            failed = e
        for slot, at, n in taken:
            del self._waiting[slot]
            if failed is not None:
                self._reading.pop(slot, None)
            self._done[slot] = (at, n) if failed is None else failed


class SlotContext:
    """Sequence ``seq_id`` of a shared context, as a :class:`Sequence` uses a context: its
    decodes go through the decoder, its outputs are read where its rows stood."""

    def __init__(self, ctx: Context, decoder: SharedDecoder, seq_id: int, n_ctx: int):
        self._ctx, self._decoder, self.seq_id = ctx, decoder, seq_id
        self.model = ctx.model
        self.n_ctx = n_ctx
        # the most rows a decode may hand the decoder at once (a verification's)
        self.n_batch = decoder.max_rows
        self._at, self._outputs = 0, []

    def decode(self, batch: Batch) -> int:
        """Hand the batch's rows to the next step; returns how many it decoded: a prompt's
        rows (logits for the last one only) fill the room the step has, the rest of them
        go in the next decode (Sequence.decode goes on from there)."""
        rows = [(t, pos, self.seq_id, out) for t, pos, _, out in batch.rows()]
        divisible = len(rows) > 1 and not any(r[3] for r in rows[:-1])
        self._at, n = self._decoder.decode(self.seq_id, rows, divisible, self._ctx)
        self._outputs = [i for i, r in enumerate(rows[:n]) if r[3]]
        return n

    def _index(self, i: int) -> int:
        """The shared batch's index of this slot's output ``i`` (a row index, or from the
        end of its outputs where negative, as llama.cpp reads them)."""
        if i < 0:
            if -i > len(self._outputs):
                raise SpeceeError(f"no output {i} in slot {self.seq_id}'s last decode")
            return self._at + self._outputs[i]
        return self._at + i

    def argmax(self, i: int = -1) -> int:
        with self._decoder.lock:
            return self._ctx.argmax(self._index(i))

    def logits(self, i: int = -1) -> np.ndarray:
        with self._decoder.lock:
            return self._ctx.logits(self._index(i))

    def confidence(self, i: int = -1) -> tuple[int, float, float]:
        with self._decoder.lock:
            return self._ctx.confidence(self._index(i))

    def seq_rm(self, p0: int, p1: int = -1) -> None:
        with self._decoder.lock:
            self._ctx.seq_rm(p0, p1, seq_id=self.seq_id)

    def clear(self) -> None:
        self.seq_rm(0)

    def __getattr__(self, name: str):
        if name.startswith("stage_"):
            raise SpeceeError("a staged decode (early exit) runs one batch layer by layer and "
                              "cannot share a step with other slots")
        raise AttributeError(name)


class _SlotTarget:
    """A slot's target: the model, the slot's context view and its sequence."""

    def __init__(self, ctx: SlotContext):
        self.model, self.ctx, self.seq = ctx.model, ctx, Sequence(ctx)


class SlotLLM:
    """What a mode sees of ``llm`` in one slot: the target's sequence is the slot's, and where
    the slots run the draft model, the draft's sequence too; the rest (models, tokenizer,
    what modes derived once) is the LLM's."""

    shares_steps = True     # a mode runs its slot variant (speculative/mode.py)

    def __init__(self, llm, ctx: SlotContext, draft_ctx: SlotContext | None = None):
        self._llm = llm
        self.tgt = _SlotTarget(ctx)
        self._dft = _SlotTarget(draft_ctx) if draft_ctx is not None else None

    def __getattr__(self, name: str):
        return getattr(self._llm, name)

    @property
    def model(self):
        return self.tgt.model

    @property
    def n_ctx(self) -> int:
        return self.tgt.ctx.n_ctx

    @property
    def n_slots(self) -> int:
        """The slots decoding at once (this one among them)."""
        return self._llm.tgt.n_seq

    @property
    def dft(self):
        if self._dft is None:
            raise SpeceeError("no draft model runs in this server's slots (start it with "
                              "--draft and --gamma N for one)")
        return self._dft

    def release_draft(self) -> None:
        """Nothing: the draft's context is every slot's."""

    def set_draft_flash_attn(self, flash_attn) -> None:
        raise SpeceeError("a slot's draft context is every slot's: it is not opened again")

    def reset(self) -> None:
        self.tgt.seq.rewind(0)
        if self._dft is not None:
            self._dft.seq.rewind(0)

    stream = LLM.stream
    generate = LLM.generate


def slots(llm) -> tuple[SharedDecoder, list[SlotLLM]]:
    """The decoder of ``llm``'s target context (and of its draft's, where slots run the
    draft: ``llm.slots_draft``) and one SlotLLM per sequence it holds
    (``LoadConfig.n_seq``)."""
    ctx = llm.tgt.ctx
    dft = llm.dft.ctx if llm.slots_draft else None
    decoder = SharedDecoder(ctx, draft_ctx=dft)
    return decoder, [SlotLLM(llm, SlotContext(ctx, decoder, i, llm.n_ctx),
                             SlotContext(dft, decoder, i, llm.n_ctx) if dft else None)
                     for i in range(llm.tgt.n_seq)]

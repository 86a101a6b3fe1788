"""The threads that run requests: one, or one per slot, taking them in arrival order.

With one slot a single worker thread owns the model pair and runs each request to its end.
With ``parallel`` slots each slot's thread runs the requests handed to it on its own sequence
of the target's context; their decodes meet in one batch a step (engine/slots.py), the only
place the context is driven from. A request goes to the free slot whose cache holds most of
its prompt (a conversation's next turn to its last turn's slot), so that its history is not
read again. HTTP handlers (on the event loop) put a :class:`Job` in a bounded queue and read
its steps back from an asyncio queue; a job whose client went away is marked cancelled and
its slot stops it before the next token is decoded (plain and speculative strategies decode
only when the next step is asked for).
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..bindings._ffi import release_openmp_threads
from ..config import SamplingConfig
from ..engine.llm import LLM
from ..engine.modes import Mode
from ..engine.sequence import common_prefix
from ..errors import SpeceeError

log = logging.getLogger("specee_cpp.server")

END = object()          # the last item a job's event queue receives
# seconds without a request after start before the measurements take idle time
IDLE_START_S = 30.0


class QueueFull(SpeceeError):
    """The bounded queue is full; ``retry_after`` is the wait it estimates, in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Job:
    """One request's generation: what to run and where its steps go."""

    prompt: list[int]   # token ids: the request handler tokenized it to check its length
    max_tokens: int
    sampling: SamplingConfig
    stops: tuple[str, ...]
    mode: Mode
    options: Any
    ignore_eos: bool = False
    prediction: list[int] | None = None   # the predicted output's token ids
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Step | Exception | END
    cancel: threading.Event = field(default_factory=threading.Event)
    cancelled_at: float | None = None   # perf_counter when the client was found gone
    slot: int | None = None     # the slot it was handed to

    def put(self, item: Any) -> None:
        """Hand an item to the handler's event loop (called from the worker thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def stop(self) -> None:
        """The client is gone: the worker decodes no further token for this job."""
        if not self.cancel.is_set():
            self.cancelled_at = time.perf_counter()
            self.cancel.set()


@dataclass
class Counters:
    """What /health reports: served, cancelled and refused requests, and the last cancel."""

    served: int = 0
    failed: int = 0
    cancelled: int = 0
    refused: int = 0
    # the last cancelled job: steps produced after its client was found gone (at most the
    # one in flight), and how long after that its slot was free
    last_cancel: dict = field(default_factory=dict)


class Worker:
    """Owns ``llm``; runs queued jobs on one thread per slot (``llm``'s sequences,
    ``LoadConfig.n_seq``)."""

    def __init__(self, llm: LLM, max_queue: int = 16, idle=None):
        if max_queue < 1:
            raise SpeceeError(f"--max-queue must be at least 1, got {max_queue}")
        self.llm = llm
        self.max_queue = max_queue
        self._busy: dict[int, Job] = {}   # id -> a running job
        self._recent: deque[float] = deque(maxlen=8)   # seconds per finished job
        self.counters = Counters()
        self.slots = llm.tgt.n_seq
        if self.slots == 1:
            views = [llm]
            self.decoder = None
            # what this machine's timings still lack, measured between requests
            # (engine/idle.py), or None
            self.idle = idle
        else:
            from ..engine.decode_kernels import settle
            from ..engine.slots import slots

            # measuring takes the whole machine, which is never idle between requests of
            # several slots: the read-ahead is timed now, the costs come from `specee-cpp costs`
            settle(llm)
            self.decoder, views = slots(llm)
            self.idle = None
        # the requests decode on the slots' threads (the steps' thread): the thread that
        # loaded the model, and measured this machine, gives back the OpenMP team it decoded
        # with, else every decode would run slower (bindings._ffi.release_openmp_threads)
        release_openmp_threads()
        self._views = views
        # jobs go to slots here, under this lock: the queue in arrival order, the free slots
        # in the order they were freed, the job handed to each slot until it takes it
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._free: list[int] = list(range(len(views)))
        self._handed: dict[int, Job] = {}
        self._closing = False
        self._threads = [threading.Thread(target=self._run, args=(i, view), daemon=True,
                                          name=f"specee-cpp-slot-{i}")
                         for i, view in enumerate(views)]
        for t in self._threads:
            t.start()

    # ---- the event loop's side ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise :class:`QueueFull` when ``max_queue`` jobs already wait."""
        job.loop = asyncio.get_running_loop()
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self.counters.refused += 1
                raise QueueFull(f"server busy: {self.max_queue} requests already wait "
                                f"(--max-queue {self.max_queue})", self.retry_after())
            self._queue.append(job)
            self._dispatch()

    def _dispatch(self) -> None:
        """With the lock held: hand the queued jobs, first come first, to free slots, each
        to the free slot where it leaves the fewest tokens to read again (``_kept``), among
        equals the one free the longest."""
        while self._queue and self._free:
            job = self._queue.popleft()
            # one free slot is taken unscored: a lone slot may be measuring costs while it
            # waits (idle), its cache in use, which _kept must not read
            slot = max(self._free, key=lambda i: (self._kept(i, job.prompt),
                                                  -self._free.index(i))) \
                if len(self._free) > 1 else self._free[0]
            self._free.remove(slot)
            self._handed[slot] = job
            job.slot = slot
            self._cond.notify_all()

    def _kept(self, slot: int, prompt: list[int]) -> int:
        """What running ``prompt`` in free slot ``slot`` saves: the start of it that the
        slot's cache holds is not read now, the rest of the cache is dropped and is read
        again if its conversation comes back. So a conversation's next turn goes back to its
        slot, a new one to an empty slot rather than over another conversation that merely
        starts with the same system prompt."""
        cached = self._views[slot].tgt.seq.tokens      # the slot is free: its thread waits
        n = common_prefix(cached, prompt)
        return n - (len(cached) - n)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: a slot frees when its job ends, so the mean
        of the recent jobs' durations over the slots."""
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(per_job / self.slots))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._busy)

    @property
    def running(self) -> int:
        """Slots running a request."""
        return len(self._busy)

    def close(self) -> None:
        """Stop the running jobs and the threads (pending jobs are dropped)."""
        with self._cond:
            self._closing = True
            for job in [*self._busy.values(), *self._queue, *self._handed.values()]:
                job.stop()    # a job handed to a slot but not started ends there
            for job in self._queue:
                job.put(END)
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        if self.idle is not None:   # a timing paused mid-way holds a context of the model
            self.idle.close()

    # ---- the slots' threads -----------------------------------------------------------------

    def _run(self, slot: int, llm) -> None:
        """Slot ``slot``: jobs run on ``llm`` (the LLM, or this slot's view of it)."""
        served = False
        while True:
            job = self._next(slot, served)
            served = True
            if job is None:
                return
            if job.cancel.is_set():          # its client left while it waited
                self.counters.cancelled += 1
                self._busy.pop(id(job), None)
                self._free_slot(slot)
                job.put(END)
                continue
            t0 = time.perf_counter()
            try:
                self._generate(job, llm)
            finally:
                self._busy.pop(id(job), None)
                self._recent.append(time.perf_counter() - t0)
                # free before the client hears the end: its next turn finds this slot free
                self._free_slot(slot)
                job.put(END)

    def _free_slot(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._dispatch()

    def _next(self, slot: int, served: bool) -> Job | None:
        """The job handed to ``slot`` (None: close). While it has none, what this
        machine's timings still lack takes the idle time one timed sample at a time (a
        request that arrives waits for the sample in flight only); before the first request
        only once none came for IDLE_START_S, so a client that starts with the server gets
        its first answer at once."""
        def handed() -> bool:
            return slot in self._handed or self._closing

        with self._cond:
            if self.idle is not None and not handed():
                if served or not self._cond.wait_for(handed, timeout=IDLE_START_S):
                    self._cond.release()   # the measurement runs unlocked: jobs still come
                    try:
                        self.idle.run(stop=handed)
                    finally:
                        self._cond.acquire()
            self._cond.wait_for(handed)
            job = self._handed.pop(slot, None)
            if job is not None:   # running from now: close() stops it
                self._busy[id(job)] = job
            return job

    def _generate(self, job: Job, llm) -> None:
        if self.decoder is not None:
            self.decoder.enter()
        try:
            self._steps(job, llm)
        finally:
            if self.decoder is not None:
                self.decoder.leave(llm.tgt.ctx.seq_id)

    def _steps(self, job: Job, llm) -> None:
        after_cancel = 0
        try:
            job.mode.prepare(llm, job.options)
            steps = llm.stream(job.prompt, max_tokens=job.max_tokens,
                                    sampling=job.sampling, stop=job.stops,
                                    mode=job.mode, options=job.options,
                                    ignore_eos=job.ignore_eos, prediction=job.prediction)
            try:
                # checked before each step is asked for (asking is what decodes), and after:
                # the step in flight when the client left is the only one it pays for
                while not job.cancel.is_set():
                    step = next(steps, None)
                    if step is None:
                        break
                    if job.cancel.is_set():
                        after_cancel += 1
                        break
                    job.put(step)
            finally:
                steps.close()   # the strategy rewinds its KV state: the next job starts clean
        except SpeceeError as e:
            self.counters.failed += 1
            job.put(e)
            return
        except Exception as e:  # a bug: logged with its traceback here, one line to the client
            log.exception("generation failed")
            self.counters.failed += 1
            job.put(e)
            return
        if job.cancel.is_set():
            self.counters.cancelled += 1
            self.counters.last_cancel = {
                "steps_after_cancel": after_cancel,
                "freed_after_ms": round((time.perf_counter() - job.cancelled_at) * 1e3, 1)}
        else:
            self.counters.served += 1

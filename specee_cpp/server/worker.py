"""The one thread that touches the models: requests run one at a time, in arrival order.

llama.cpp contexts are not safe to drive from two threads, and a 2-core laptop gains
nothing from interleaving two generations, so the server keeps one model pair and one
worker thread. HTTP handlers (on the event loop) put a :class:`Job` in a bounded queue and
read its steps back from an asyncio queue; a job whose client went away is marked cancelled
and the worker stops it before the next token is decoded (plain and speculative strategies
decode only when the next step is asked for).
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import SamplingConfig
from ..engine.llm import LLM
from ..engine.modes import Mode
from ..errors import SpeceeError

log = logging.getLogger("specee_cpp.server")

END = object()          # the last item a job's event queue receives
# seconds without a request after start before the cost measurement takes idle time
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
    """Owns ``llm``; runs queued jobs one at a time on its own thread."""

    def __init__(self, llm: LLM, max_queue: int = 16, idle=None):
        if max_queue < 1:
            raise SpeceeError(f"--max-queue must be at least 1, got {max_queue}")
        self.llm = llm
        # the machine's costs, measured between requests (speculative/idle.py), or None
        self.idle = idle
        self.max_queue = max_queue
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._busy: Job | None = None
        self._recent: deque[float] = deque(maxlen=8)   # seconds per finished job
        self.counters = Counters()
        self._thread = threading.Thread(target=self._run, name="specee-cpp-worker", daemon=True)
        self._thread.start()

    # ---- the event loop's side ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise :class:`QueueFull` when ``max_queue`` jobs already wait."""
        job.loop = asyncio.get_running_loop()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.counters.refused += 1
            raise QueueFull(f"server busy: {self.max_queue} requests already wait "
                            f"(--max-queue {self.max_queue})", self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: a slot frees when the running job ends, so
        the mean of the recent jobs' durations."""
        per_job = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(per_job))

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._busy is not None

    def close(self) -> None:
        """Stop the running job and the thread (pending jobs are dropped)."""
        if self._busy is not None:
            self._busy.stop()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.stop()
            job.put(END)
        self._jobs.put(None)   # may block briefly if full: the worker is draining it
        self._thread.join(timeout=30)

    # ---- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        served = False
        while True:
            job = self._next(served)
            served = True
            if job is None:
                return
            if job.cancel.is_set():          # its client left while it waited
                self.counters.cancelled += 1
                job.put(END)
                continue
            self._busy = job
            t0 = time.perf_counter()
            try:
                self._generate(job)
            finally:
                self._busy = None
                self._recent.append(time.perf_counter() - t0)
                job.put(END)

    def _next(self, served: bool):
        """The next job (None: close). While none waits, the cost measurement takes the idle
        time one timed sample at a time (a request that arrives waits for the sample in
        flight only); before the first request only once none came for IDLE_START_S, so a
        client that starts with the server gets its first answer at once."""
        if self.idle is not None and self._jobs.empty():
            if not served:
                try:
                    return self._jobs.get(timeout=IDLE_START_S)
                except queue.Empty:
                    pass
            self.idle.run(stop=lambda: not self._jobs.empty())
        return self._jobs.get()

    def _generate(self, job: Job) -> None:
        after_cancel = 0
        try:
            job.mode.prepare(self.llm, job.options)
            steps = self.llm.stream(job.prompt, max_tokens=job.max_tokens,
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

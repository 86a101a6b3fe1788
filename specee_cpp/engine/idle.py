"""Measurements of this machine taken in idle time, one after the other.

Chat hands the time its user spends typing, and a server of one request at a time the time
between requests, to what its models still lack here: the decode kernels
(engine/decode_kernels.py) first, since every later timing decodes with them, then the pair's
cost table (speculative/idle.py). Each job takes slices of one timed decode, so an answer waits
at most for the slice in flight.
"""
from __future__ import annotations

from typing import Callable, Protocol


class IdleJob(Protocol):
    def pending(self) -> bool: ...

    def run(self, stop: Callable[[], bool]) -> bool: ...

    def close(self) -> None: ...


class IdleWork:
    """Jobs run in order: a job starts once those before it are done (or have failed)."""

    def __init__(self, jobs: list[IdleJob | None]):
        self.jobs = [job for job in jobs if job is not None]

    def pending(self) -> bool:
        return any(job.pending() for job in self.jobs)

    def run(self, stop: Callable[[], bool]) -> bool:
        """Slices until ``stop()`` or every job is done (True)."""
        for job in self.jobs:
            if job.pending():
                job.run(stop)
                if job.pending():   # stopped in the middle
                    return False
        return True

    def close(self) -> None:
        """Stop the jobs in progress, freeing their contexts before the models go."""
        for job in self.jobs:
            job.close()


def idle_work(llm, then: IdleJob | None, log: Callable[[str], None]) -> IdleWork:
    """What ``llm``'s idle time measures: the decode kernels where its load left them to
    idle time, then ``then`` (the pair's costs, or None); each says what it found in ``log``."""
    from .decode_kernels import IdleDecodeKernels

    return IdleWork([IdleDecodeKernels(llm, log), then])

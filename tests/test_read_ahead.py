"""The x86 kernels' weight read-ahead (patch 0013) is off until measured on the machine:
the first load of a model times it on and off, keeps the faster (past a margin), caches it;
chat's load leaves the timing to idle time; a hand-set SPECEE_CPP_READ_AHEAD wins over
all."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import specee_cpp
from specee_cpp.bindings import kernel_switch
from specee_cpp.config import READ_AHEAD_BYTES
from specee_cpp.engine import read_ahead
from specee_cpp.engine.idle import IdleWork
from specee_cpp.engine.llm import LLM

pytestmark = pytest.mark.skipif(kernel_switch("READ_AHEAD") is None,
                                reason="no read-ahead in this library (x86 CPU backend)")


def test_kept_only_past_the_margin():
    seen = {"distance": 4608, "off": 1.0}
    assert read_ahead.choose(dict(seen, on=0.9)) == 4608
    assert read_ahead.choose(dict(seen, on=0.99)) == 0      # within noise: off
    assert read_ahead.choose(dict(seen, on=1.1)) == 0


def start(env: dict) -> str:
    code = "from specee_cpp.bindings import kernel_switch; print(kernel_switch('READ_AHEAD'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    return r.stdout.strip()


def test_the_library_starts_with_it_off_unless_set_by_hand():
    env = {k: v for k, v in os.environ.items() if k != "SPECEE_CPP_READ_AHEAD"}
    assert start(env) == "0"
    assert start(dict(env, SPECEE_CPP_READ_AHEAD="1024")) == "1024"
    assert start(dict(env, SPECEE_CPP_READ_AHEAD="-64")) == "0"


def test_measured_once_per_model_and_machine_then_read(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        distance, source = llm.read_ahead
        assert source.startswith("measured on this machine now") and "ms without" in source
        assert distance in (0, READ_AHEAD_BYTES) and kernel_switch("READ_AHEAD") == distance
    files = list((tmp_path / "costs").glob("read-ahead-*.json"))
    assert len(files) == 1
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        assert llm.read_ahead[1].startswith(f"measured on this machine ({files[0].name})")
    [(name, on, t_on, t_off)] = read_ahead.measured()
    assert name.startswith("tiny-llama") and name.endswith("(1 thread)") and on == (distance > 0) and t_on > 0 and t_off > 0
    from specee_cpp.doctor import prefetch_state

    assert f"{name}: {'on' if on else 'off'}" in prefetch_state("AVX2 = 1", distance)


def test_set_by_hand_it_is_not_measured(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.setenv("SPECEE_CPP_READ_AHEAD", "2048")
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        assert llm.read_ahead == (2048, "SPECEE_CPP_READ_AHEAD in the environment")
    assert not (tmp_path / "costs").exists() or not list((tmp_path / "costs").glob("read-*"))


def test_a_load_that_does_not_measure_leaves_it_to_idle_slices(tiny_llama, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    cfg = specee_cpp.LoadConfig(n_ctx=128, n_threads=1)
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        assert llm.read_ahead == (0, read_ahead.NOT_YET) and kernel_switch("READ_AHEAD") == 0
        lines: list[str] = []
        job = read_ahead.IdleReadAhead(llm, lines.append)
        assert job.pending() and not job.run(stop=lambda: True) and job.pending()
        # between slices (a reply may decode there) the read-ahead is as before the timing,
        # though half of the timed decodes run with it on
        between = []

        def after(n):
            def stop():
                between.append(kernel_switch("READ_AHEAD"))
                return len(between) >= n
            return stop

        assert not job.run(stop=after(5)) and job.pending() and set(between) == {0}
        job.close()                      # stopped half-way: its context is freed; begins again
        assert kernel_switch("READ_AHEAD") == 0 and job.pending()
        assert not list((tmp_path / "costs").glob("read-ahead-*.json"))
        assert job.run(stop=after(10_000)) and not job.pending()
        # from the start again, a decode a slice: the prompt, then 2 + 16 turns of on and off
        assert set(between) == {0} and len(between) - 5 == 1 + 2 * (2 + 16) + 1
        distance, source = llm.read_ahead
        assert source.startswith("measured on this machine now") and "ms without" in source
        assert kernel_switch("READ_AHEAD") == distance and distance in (0, READ_AHEAD_BYTES)
        assert lines == [f"weight read-ahead {'on' if distance else 'off'} for tiny-llama.gguf, "
                         f"{source}"]
    assert len(list((tmp_path / "costs").glob("read-ahead-*.json"))) == 1
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:   # cached: nothing left
        assert llm.read_ahead[0] == distance and llm.read_ahead[1].startswith(
            "measured on this machine (read-ahead-")
        assert not read_ahead.IdleReadAhead(llm).pending()


class _Job:
    """An idle job of ``slices`` slices that records what ran."""

    def __init__(self, name, slices, ran):
        self.name, self.left, self.ran, self.closed = name, slices, ran, False

    def pending(self):
        return self.left > 0

    def run(self, stop):
        while self.left and not stop():
            self.left -= 1
            self.ran.append(self.name)
        return not self.left

    def close(self):
        self.closed = True


def test_idle_jobs_run_one_after_the_other():
    ran: list[str] = []
    jobs = [_Job("read-ahead", 3, ran), None, _Job("costs", 2, ran)]
    work = IdleWork(jobs)
    budget = iter(range(4))
    assert not work.run(stop=lambda: next(budget, None) is None) and work.pending()
    assert ran == ["read-ahead"] * 3 + ["costs"]
    assert work.run(stop=lambda: False) and not work.pending()
    assert ran == ["read-ahead"] * 3 + ["costs"] * 2
    work.close()
    assert all(j.closed for j in work.jobs) and len(work.jobs) == 2


def test_what_has_no_idle_time_times_it_first(tiny_llama, tmp_path, monkeypatch):
    """A step of several slots is timed against one token as a server will run them, the
    read-ahead decided first; a server's slots, never idle, start with it decided; a
    server of one request at a time leaves it to its idle jobs, and stops them on close."""
    from specee_cpp.engine import slot_step
    from specee_cpp.server.worker import Worker

    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "step"))
    at_step = []
    time_step = slot_step.time_step
    monkeypatch.setattr(slot_step, "time_step",
                        lambda *a, **k: at_step.append(llm.read_ahead[1]) or time_step(*a, **k))
    cfg = specee_cpp.LoadConfig(n_ctx=256, n_threads=1)
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        slot_step.step_timing(llm)
        assert len(at_step) == 1 and at_step[0].startswith("measured on this machine now")

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "slots"))
    with LLM(str(tiny_llama), config=specee_cpp.LoadConfig(n_ctx=256, n_threads=1, n_seq=2),
             measure_now=False) as llm:
        assert llm.read_ahead[1] == read_ahead.NOT_YET
        worker = Worker(llm)
        worker.close()
        assert llm.read_ahead[1].startswith("measured on this machine now")

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "one"))
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        job = _Job("read-ahead", 3, [])
        worker = Worker(llm, idle=job)
        assert worker.idle is job
        worker.close()
        assert job.closed and llm.read_ahead[1] == read_ahead.NOT_YET


def test_a_server_of_one_request_at_a_time_times_it_between_requests(tiny_llama, tmp_path):
    """A new machine's server listens before the read-ahead is timed; the timing follows
    the first answer, in idle time, and is cached."""
    import json
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k != "SPECEE_CPP_READ_AHEAD"}
    env.update(SPECEE_CPP_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "serve", str(tiny_llama),
                          "--mode", "plain", "--parallel", "1", "--port", "0", "--n-ctx", "128",
                          "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cached = lambda: list(tmp_path.glob("costs/read-ahead-*.json"))   # noqa: E731
    try:
        url = p.stdout.readline().split()[-1]
        assert url.startswith("http://") and not cached()
        req = urllib.request.Request(url + "/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps(
                {"prompt": "Hi", "max_tokens": 2}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
        for _ in range(600):
            if cached():
                break
            time.sleep(0.1)
        assert len(cached()) == 1
    finally:
        p.terminate()
        _, stderr = p.communicate(timeout=30)
    assert "weight read-ahead" in stderr and "Traceback" not in stderr, stderr

"""The x86 kernel switches of a one-token decode (the weights' read-ahead, patch 0013;
repacked Q4_K's rows kernel for one row, 0015) are off until measured on the machine: the
first load of a model times each that its kernels use on and off, keeps the faster (past a
margin), caches the choices; chat's load leaves the timing to idle time; a switch set by
hand (SPECEE_CPP_<switch>) wins over all."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specee_cpp
from specee_cpp.bindings import kernel_switch
from specee_cpp.config import READ_AHEAD_BYTES
from specee_cpp.engine import decode_kernels as dk
from specee_cpp.engine.idle import IdleWork
from specee_cpp.engine.llm import LLM

pytestmark = pytest.mark.skipif(kernel_switch("ONE_ROW") is None,
                                reason="no decode kernel switches in this library")


def test_kept_only_past_the_margin():
    seen = {"value": 4608, "off": 1.0}
    assert dk.choose(dict(seen, on=0.9)) == 4608
    assert dk.choose(dict(seen, on=0.99)) == 0      # within noise: off
    assert dk.choose(dict(seen, on=1.1)) == 0


def start(env: dict, switch: str) -> str:
    code = f"from specee_cpp.bindings import kernel_switch; print(kernel_switch('{switch}'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    return r.stdout.strip()


@pytest.mark.parametrize("switch", list(dk.SWITCHES))
def test_the_library_starts_with_them_off_unless_set_by_hand(switch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_CPP_")}
    assert start(env, switch) == "0"
    assert start(dict(env, **{f"SPECEE_CPP_{switch}": "1024"}), switch) == "1024"
    assert start(dict(env, **{f"SPECEE_CPP_{switch}": "-64"}), switch) == "0"


class _Target:
    """What _applicable reads of an LLM: its config's GPU layers, its weight types."""

    def __init__(self, types: set[str], gpu_layers: int = 0):
        self.config = type("C", (), {"n_gpu_layers": gpu_layers})()
        self.model = type("M", (), {"info": type("I", (), {"weight_types": frozenset(types)})()})()


def test_each_switch_is_timed_only_where_its_kernels_decode_the_target(monkeypatch):
    """The read-ahead is in every x86 AVX2 kernel; the one-row kernel only in repacked
    Q4_K's, which AMX's buffer replaces where the CPU has AMX (unless switched off); the
    weights on the GPU, or a CPU without AVX2, time nothing. A switch set by hand is not
    timed."""
    from specee_cpp import bindings

    for k in ("AMX", "ONE_ROW", "READ_AHEAD"):
        monkeypatch.delenv(f"SPECEE_CPP_{k}", raising=False)
    info = {"system_info": "AVX2 = 1 | REPACK = 1"}
    monkeypatch.setattr(bindings, "library_info", lambda: info)
    q4_k, f16 = _Target({"Q4_K", "Q6_K", "F32"}), _Target({"F16", "F32"})
    assert dk._timed(q4_k) == ["ONE_ROW", "READ_AHEAD"]
    assert dk._timed(f16) == ["READ_AHEAD"]
    assert dk._timed(_Target({"Q4_K"}, gpu_layers=99)) == []
    info["system_info"] = "AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1"
    assert dk._timed(q4_k) == ["READ_AHEAD"]
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")                 # --no-amx: the repack decodes
    assert dk._timed(q4_k) == ["ONE_ROW", "READ_AHEAD"]
    monkeypatch.setenv("SPECEE_CPP_READ_AHEAD", "0")          # set by hand
    assert dk._timed(q4_k) == ["ONE_ROW"]
    info["system_info"] = "NEON = 1 | REPACK = 1"
    assert dk._timed(q4_k) == []


def test_measured_once_per_model_and_machine_then_read(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        values, source = llm.decode_kernels
        assert source.startswith("measured on this machine now: READ_AHEAD ")
        assert "ms without" in source
        distance = values["READ_AHEAD"]
        assert distance in (0, READ_AHEAD_BYTES) and kernel_switch("READ_AHEAD") == distance
        assert values["ONE_ROW"] == 0      # no Q4_K here: not timed, off
    files = list((tmp_path / "costs").glob("decode-kernels-*.json"))
    assert len(files) == 1
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        assert llm.decode_kernels.source.startswith(
            f"measured on this machine ({files[0].name})")
        assert llm.decode_kernels.values == values
    [(name, switch, on, t_on, t_off)] = dk.measured()
    assert name.startswith("tiny-llama") and name.endswith("(1 thread)")
    assert switch == "READ_AHEAD" and on == (distance > 0) and t_on > 0 and t_off > 0
    from specee_cpp.doctor import decode_kernel_state

    assert f"{name}: {'on' if on else 'off'}" in decode_kernel_state("AVX2 = 1", "READ_AHEAD",
                                                                     distance)


def test_set_by_hand_it_is_not_measured(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.setenv("SPECEE_CPP_READ_AHEAD", "2048")
    with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
        # what the library runs (it read the variable when this process started it)
        assert llm.decode_kernels.values["READ_AHEAD"] == kernel_switch("READ_AHEAD")
        assert llm.decode_kernels.source == "set in the environment"
    assert not (tmp_path / "costs").exists() or not list((tmp_path / "costs").glob("decode-*"))


def test_a_load_that_does_not_measure_leaves_it_to_idle_slices(tiny_llama, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    cfg = specee_cpp.LoadConfig(n_ctx=128, n_threads=1)
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        assert llm.decode_kernels.source == dk.NOT_YET and kernel_switch("READ_AHEAD") == 0
        lines: list[str] = []
        job = dk.IdleDecodeKernels(llm, lines.append)
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
        assert not list((tmp_path / "costs").glob("decode-kernels-*.json"))
        assert job.run(stop=after(10_000)) and not job.pending()
        # from the start again, a decode a slice: the prompt, then 2 + 16 turns of on and off
        assert set(between) == {0} and len(between) - 5 == 1 + 2 * (2 + 16) + 1
        values, source = llm.decode_kernels
        distance = values["READ_AHEAD"]
        assert source.startswith("measured on this machine now") and "ms without" in source
        assert kernel_switch("READ_AHEAD") == distance and distance in (0, READ_AHEAD_BYTES)
        assert lines == [f"decode kernels for tiny-llama.gguf: {source}"]
    assert len(list((tmp_path / "costs").glob("decode-kernels-*.json"))) == 1
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:   # cached: nothing left
        assert llm.decode_kernels.values == values and llm.decode_kernels.source.startswith(
            "measured on this machine (decode-kernels-")
        assert not dk.IdleDecodeKernels(llm).pending()


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
    jobs = [_Job("kernels", 3, ran), None, _Job("costs", 2, ran)]
    work = IdleWork(jobs)
    budget = iter(range(4))
    assert not work.run(stop=lambda: next(budget, None) is None) and work.pending()
    assert ran == ["kernels"] * 3 + ["costs"]
    assert work.run(stop=lambda: False) and not work.pending()
    assert ran == ["kernels"] * 3 + ["costs"] * 2
    work.close()
    assert all(j.closed for j in work.jobs) and len(work.jobs) == 2


def test_what_has_no_idle_time_times_it_first(tiny_llama, tmp_path, monkeypatch):
    """A step of several slots is timed against one token as a server will run them, the
    decode kernels decided first; a server's slots, never idle, start with them decided; a
    server of one request at a time leaves it to its idle jobs, and stops them on close."""
    from specee_cpp.engine import slot_step
    from specee_cpp.server.worker import Worker

    monkeypatch.delenv("SPECEE_CPP_READ_AHEAD", raising=False)
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "step"))
    at_step = []
    time_step = slot_step.time_step
    monkeypatch.setattr(slot_step, "time_step",
                        lambda *a, **k: at_step.append(llm.decode_kernels.source)
                        or time_step(*a, **k))
    cfg = specee_cpp.LoadConfig(n_ctx=256, n_threads=1)
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        slot_step.step_timing(llm)
        assert len(at_step) == 1 and at_step[0].startswith("measured on this machine now")

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "slots"))
    with LLM(str(tiny_llama), config=specee_cpp.LoadConfig(n_ctx=256, n_threads=1, n_seq=2),
             measure_now=False) as llm:
        assert llm.decode_kernels.source == dk.NOT_YET
        worker = Worker(llm)
        worker.close()
        assert llm.decode_kernels.source.startswith("measured on this machine now")

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "one"))
    with LLM(str(tiny_llama), config=cfg, measure_now=False) as llm:
        job = _Job("kernels", 3, [])
        worker = Worker(llm, idle=job)
        assert worker.idle is job
        worker.close()
        assert job.closed and llm.decode_kernels.source == dk.NOT_YET


def test_a_server_of_one_request_at_a_time_times_it_between_requests(tiny_llama, tmp_path):
    """A new machine's server listens before the decode kernels are timed; the timing follows
    the first answer, in idle time, and is cached."""
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k != "SPECEE_CPP_READ_AHEAD"}
    env.update(SPECEE_CPP_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "serve", str(tiny_llama),
                          "--mode", "plain", "--parallel", "1", "--port", "0", "--n-ctx", "128",
                          "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cached = lambda: list(tmp_path.glob("costs/decode-kernels-*.json"))   # noqa: E731
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
    assert "decode kernels for" in stderr and "Traceback" not in stderr, stderr


def _repacks_x86() -> bool:
    from specee_cpp.bindings import library_info

    info = library_info()["system_info"]
    return "REPACK = 1" in info and "AVX2 = 1" in info


@pytest.mark.skipif("not _repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
def test_a_repacked_q4_k_target_times_the_one_row_kernel_then_the_read_ahead(tmp_path):
    """Where repacked Q4_K decodes the target (x86 without AMX, or with it switched off),
    the one-row kernel is timed first and the read-ahead over the kernel chosen; both
    choices are cached together, set, and part of the cost tables' key."""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
            "from kernel_checks import make_model; import specee_cpp\n"
            "from specee_cpp.bindings import kernel_switch\n"
            "path = make_model(Path(sys.argv[2]), 'Q4_K')\n"
            "with specee_cpp.load(str(path), n_ctx=128, n_threads=2) as llm:\n"
            "    k = llm.decode_kernels\n"
            "    print(json.dumps([k.values, k.source, k.key(),\n"
            "                      {s: kernel_switch(s) for s in k.values}]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_CPP_")}
    env.update(SPECEE_CPP_HOME=str(tmp_path), SPECEE_CPP_AMX="0")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    values, source, key, live = json.loads(r.stdout)
    assert source.startswith("measured on this machine now: ONE_ROW ")
    assert "; READ_AHEAD " in source and values == live
    assert values["ONE_ROW"] in (0, 1) and values["READ_AHEAD"] in (0, READ_AHEAD_BYTES)
    assert key == [f"ONE_ROW={values['ONE_ROW']}", f"READ_AHEAD={values['READ_AHEAD']}"]
    [cached] = (tmp_path / "costs").glob("decode-kernels-*.json")
    assert list(json.loads(cached.read_text())) == ["ONE_ROW", "READ_AHEAD"]

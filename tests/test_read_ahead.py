"""The x86 kernels' weight read-ahead (patch 0013) is off until measured on the machine:
the first load of a model times it on and off, keeps the faster (past a margin), caches it;
a hand-set SPECEE_CPP_READ_AHEAD wins over both."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import specee_cpp
from specee_cpp.bindings import kernel_switch
from specee_cpp.config import READ_AHEAD_BYTES
from specee_cpp.engine import read_ahead

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

"""The crash probe that set-up and `doctor` run: a real child decode, a real crash."""
import sys
from pathlib import Path

import pytest

from scripts_path import load_script
from specee_cpp.crash_probe import FAULT_ENV, run_probe


def test_probe_passes_on_this_build():
    res = run_probe()
    assert res.ok and res.returncode == 0, res.message
    assert "staged" in res.message


def test_probe_reports_a_crashing_child(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "segv")  # the child dies of a real SIGSEGV
    res = run_probe()
    assert not res.ok and res.returncode < 0
    assert "SIGSEGV" in res.message and "GGML_NATIVE=OFF" in res.message
    assert "\n" not in res.message


def test_setup_stops_on_a_crashing_build(monkeypatch, tmp_path, capsys):
    boot = load_script("bootstrap")
    monkeypatch.setattr(boot, "VENV", tmp_path)
    (tmp_path / ".specee-cpp-installed").write_text("install-hash")
    monkeypatch.setenv(FAULT_ENV, "segv")
    with pytest.raises(SystemExit) as exc:
        boot.ensure_probe(Path(sys.executable))
    assert exc.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: the patched libllama crashed (SIGSEGV)")
    assert not (tmp_path / ".specee-cpp-probed").exists()  # set-up will probe again
    monkeypatch.delenv(FAULT_ENV)
    boot.ensure_probe(Path(sys.executable))  # a good build passes and is stamped
    assert (tmp_path / ".specee-cpp-probed").read_text() == "install-hash"

"""Bad input ends in one clean line, never a traceback or an abort: corrupted GGUFs (a fixed
seed, a few dozen variants of the real small model through scripts/fuzz_gguf.py; the full run
is the script itself) and out-of-range options."""
import os
import subprocess
import sys

import pytest

from scripts_path import load_script

fuzz_gguf = load_script("fuzz_gguf")


@pytest.mark.model
def test_corrupted_gguf_variants_give_clean_errors(small_model):
    lines = []
    counts = fuzz_gguf.fuzz(small_model, n=48, seed=0, timeout=120, log=lines.append)
    bad = [ln for ln in lines if not ln.startswith(("error", "ok"))]
    assert not bad, "\n".join(bad)
    assert counts["error"] >= 40  # the targeted corruptions are all refused


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specee_cpp.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, COLUMNS="400"), timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--temperature", "0.7", "--seed", "-1"], "seed"),
    (["--gamma", "3"], "--gamma 3 applies to --mode spec"),
    (["--mode", "ee", "--threshold", "nan"], "threshold"),
    (["--mode", "ee", "--threshold", "5"], "threshold"),
    (["--threshold", "0.5"], "--threshold 0.5 applies to --mode ee"),
    (["--mode", "spec", "--provider", "ngram"], "--provider ngram applies to --mode ee, not --mode spec"),
    (["--controller", "c.npz"], "--controller c.npz applies to --mode spec, not --mode plain"),
    (["--mode", "spec", "--gamma", "often"], "gamma must be a number of tokens >= 0 or one of"),
    (["--mode", "fast"], "unknown mode 'fast'; modes: plain, spec, ee"),
    (["--no-context"], "--no-context applies to --mode spec, not --mode plain"),
])
def test_bad_options_name_the_value(tiny_llama, args, needle):
    r = cli("generate", str(tiny_llama), "-p", "hi", "-n", "2", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("error:") and needle in r.stderr, r.stderr


def test_gpu_layers_on_a_cpu_build_warns(tiny_llama):
    from specee_cpp.bindings._ffi import ll

    if ll.llama_supports_gpu_offload():
        pytest.skip("this build has a GPU backend")
    r = cli("generate", str(tiny_llama), "-p", "hi", "-n", "2", "--gpu-layers", "-1")
    assert r.returncode == 0 and "--gpu-layers -1 ignored" in r.stderr, r.stderr


def test_unreadable_model_is_one_line(tmp_path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    r = cli("generate", str(d), "-p", "hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "error:" in r.stderr


@pytest.mark.model
@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_ctrl_c_exits_130_and_says_so(small_model):
    import signal
    import time

    # A runner started in the background (`cmd &` without job control, as CI may be) passes
    # SIGINT on as ignored, and Python then installs no KeyboardInterrupt handler: give the
    # child the default back, as a terminal's foreground process has it.
    p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "generate", str(small_model),
                          "-p", "Tell a very long story.", "-n", "4000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, COLUMNS="400"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # wait for the first generated text, then interrupt as a terminal's Ctrl-C would
    p.stdout.read(1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted: specee-cpp generate" in err and "Traceback" not in err

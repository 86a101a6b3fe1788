"""Bad input ends in one clean line, never a traceback, an abort or a hang: corrupted GGUFs
(the targeted variants of the real small model through scripts/fuzz_gguf.py; the random ones
are the script's full run), text that is not text, and out-of-range options."""
import os
import subprocess
import sys

import pytest

from scripts_path import load_script

fuzz_gguf = load_script("fuzz_gguf")


@pytest.mark.model
def test_corrupted_gguf_variants_give_clean_errors(small_model):
    """Every targeted corruption (the fuzzer's fixed list, through the CLI) is one error
    line: none aborts, hangs, ends in a traceback or is taken silently."""
    n = sum(1 for _ in fuzz_gguf.targeted(fuzz_gguf.Source(small_model)))
    lines = []
    counts = fuzz_gguf.fuzz(small_model, n=n, seed=0, timeout=120, log=lines.append)
    bad = [ln for ln in lines if not ln.startswith("error")]
    assert not bad, "\n".join(bad)
    assert counts["error"] == n


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


def cli_bytes(*args: bytes, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The CLI with raw bytes for arguments and standard input (what a shell passes on)."""
    return subprocess.run([sys.executable.encode(), b"-m", b"specee_cpp.cli", *args],
                          input=stdin, capture_output=True, env=dict(os.environ, COLUMNS="400"),
                          timeout=120)


@pytest.mark.skipif(os.name == "nt", reason="POSIX argument bytes")
@pytest.mark.parametrize("extra", [[], [b"--raw"]])
def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_byte(tiny_llama, extra):
    r = cli_bytes(b"generate", bytes(tiny_llama), b"-p", b"ok \xff\xfe hi", b"-n", b"2", *extra)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert "byte 0xff is not UTF-8 (at character 3)" in err, err


def test_a_prompt_file_and_stdin_give_what_p_gives(tiny_llama, tmp_path):
    """--prompt-file reads a prompt too long for a command line (and - reads stdin): the
    answer equals -p's; bytes that are not UTF-8 there are refused the same way."""
    import json

    base = [b"generate", bytes(tiny_llama), b"-n", b"4", b"--raw", b"--json"]
    prompt = "def add(a, b):\n    return"
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    by_p = cli_bytes(*base, b"-p", prompt.encode())
    by_file = cli_bytes(*base, b"--prompt-file", bytes(f))
    by_stdin = cli_bytes(*base, b"-f", b"-", stdin=prompt.encode())
    assert by_p.returncode == by_file.returncode == by_stdin.returncode == 0, by_file.stderr
    tokens = [json.loads(r.stdout)["tokens"] for r in (by_p, by_file, by_stdin)]
    assert tokens[0] == tokens[1] == tokens[2]
    bad = cli_bytes(*base, b"-f", b"-", stdin=b"x\xc3(")
    assert bad.returncode == 1 and b"byte 0xc3 is not UTF-8 (at character 1)" in bad.stderr
    for args in ([], [b"-p", b"x", b"-f", bytes(f)]):
        r = cli_bytes(*base, *args)
        assert r.returncode == 1 and b"-p TEXT or --prompt-file PATH" in r.stderr, r.stderr
    missing = cli_bytes(*base, b"-f", bytes(tmp_path / "none.txt"))
    assert missing.returncode == 1 and b"cannot read --prompt-file" in missing.stderr


@pytest.mark.model
def test_chat_keeps_the_session_after_a_line_that_is_not_utf8(small_model):
    r = cli_bytes(b"chat", bytes(small_model), b"-n", b"3", stdin=b"caf\xe9\nhello\n/exit\n")
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "byte 0xe9 is not UTF-8" in err and "3 tokens" in err, err


def test_a_lone_surrogate_is_refused_by_the_api(tiny_llama):
    import specee_cpp
    from specee_cpp.errors import SpeceeError

    with specee_cpp.load(str(tiny_llama)) as llm:
        with pytest.raises(SpeceeError, match=r"U\+D800 is a lone surrogate"):
            llm.generate("a\ud800b", max_tokens=2, chat=False)
        with pytest.raises(SpeceeError, match=r"U\+DC00 is a lone surrogate"):
            llm.model.tokenize("\udc00")


@pytest.mark.parametrize("args, needle", [
    (["generate", "{model}", "-p", "hi", "--threads", "1000"], "1000 threads is more than"),
    (["generate", "{dir}", "-p", "hi"], "is a directory; give the .gguf file"),
    (["serve", "{model}", "--port", "70000"], "--port 70000: a port is 0..65535"),
    (["serve", "{model}", "--port", "-1"], "--port -1: a port is 0..65535"),
    (["serve", "{model}", "--api-key", ""], "--api-key (or SPECEE_CPP_API_KEY) is empty"),
    (["serve", "{model}", "--api-key", "  "], "--api-key (or SPECEE_CPP_API_KEY) is empty"),
    (["serve", "{model}", "--threads", "1000"], "1000 threads is more than"),
    (["serve", "{model}", "--parallel", "0"], "--parallel 0: 1 to 256 requests at a time"),
    (["serve", "{model}", "--parallel", "257"], "--parallel 257: 1 to 256 requests at a time"),
])
def test_options_are_refused_before_any_work(tiny_llama, tmp_path, args, needle):
    args = [a.format(model=tiny_llama, dir=tmp_path) for a in args]
    r = cli(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("error:") and needle in r.stderr, r.stderr


def test_an_empty_key_in_the_environment_is_refused(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "specee_cpp.cli", "serve", str(tiny_llama)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, COLUMNS="400", SPECEE_CPP_API_KEY=""))
    assert r.returncode == 1 and "SPECEE_CPP_API_KEY) is empty" in r.stderr, r.stderr

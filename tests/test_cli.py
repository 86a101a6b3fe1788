"""The `specee-cpp` command as a user runs it: one-line errors, JSON, chat over stdin."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest


CLI = [sys.executable, "-m", "specee_cpp.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")


def run(*args, input=None, timeout=180):
    return subprocess.run(CLI + [str(a) for a in args], input=input, capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def assert_one_line_error(r, pattern):
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert pattern in lines[0], lines[0]


def test_missing_file(tmp_path):
    assert_one_line_error(run("generate", tmp_path / "missing.gguf", "-p", "hi"), "not found")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("not a model")
    assert_one_line_error(run("generate", p, "-p", "hi"), "not a GGUF file")


def test_truncated(tmp_path, tiny_llama):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_llama.read_bytes()[:5000])
    assert_one_line_error(run("generate", p, "-p", "hi"), "truncated")


def test_unknown_registry_name():
    assert_one_line_error(run("generate", "gpt-17", "-p", "hi"), "unknown model 'gpt-17'")


def test_unsupported_architecture(tiny_unknown_arch):
    assert_one_line_error(run("generate", tiny_unknown_arch, "-p", "hi"), "notanarch")


def test_draft_with_other_tokenizer(small_model, tiny_llama):
    r = run("generate", small_model, "--draft", tiny_llama, "-p", "hi")
    assert_one_line_error(r, "does not share the tokenizer")


def test_bad_option_value(small_model):
    assert_one_line_error(run("generate", small_model, "-p", "hi", "--top-p", "2"), "top_p")


def test_generate_json(small_model):
    r = run("generate", small_model, "-p", "Say hello.", "-n", "16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["text"].strip() and len(doc["tokens"]) == doc["stats"]["n_gen"] <= 16
    assert doc["stats"]["decode_tps"] > 0 and doc["mode"] == "plain"


def test_generate_text_streams_and_reports_speed(small_model):
    r = run("generate", "smollm2-135m", "-p", "Say hello.", "-n", "8")
    assert r.returncode == 0 and r.stdout.strip()
    assert "tok/s" in r.stderr


def test_generate_says_how_to_measure_what_it_drafts_without(small_model, tmp_path):
    # one answer has no idle time: the costs a draft model needs are never measured by
    # generate itself, so it says which command measures them; plain decoding needs none
    env = dict(ENV, SPECEE_CPP_HOME=str(tmp_path / "home"))
    r = subprocess.run(CLI + ["generate", str(small_model), "--draft", str(small_model), "-p",
                              "Say hello.", "-n", "8"], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    hint = " ".join(r.stderr.split())
    assert f"`specee-cpp costs {small_model} --draft {small_model}` measures them" in hint, hint
    assert hint.index("tok/s") < hint.index("specee-cpp costs")   # after the answer's stats
    r = subprocess.run(CLI + ["generate", str(small_model), "-p", "Say hello.", "-n", "8"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0 and "specee-cpp costs" not in r.stderr, r.stderr


def test_generate_and_chat_with_a_prediction(small_model, tmp_path):
    assert_one_line_error(run("generate", small_model, "-p", "hi", "--prediction",
                              tmp_path / "missing.txt"), "cannot read --prediction")
    assert_one_line_error(run("generate", small_model, "-p", "hi", "--prediction",
                              tmp_path), "cannot read --prediction")
    want = json.loads(run("generate", small_model, "-p", "Say hello.", "-n", "16",
                          "--json").stdout)
    pred = tmp_path / "pred.txt"
    pred.write_text(want["text"], encoding="utf-8")
    assert_one_line_error(run("generate", small_model, "--draft", small_model, "-p", "hi",
                              "--prediction", pred, "--mode", "spec-ee"),
                          "--prediction: mode spec-ee")
    r = run("generate", small_model, "-p", "Say hello.", "-n", "16", "--json",
            "--prediction", pred)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want["tokens"]
    assert doc["stats"]["prediction"]["accepted"] >= len(want["tokens"]) - 2
    assert doc["stats"]["drafted_by_source"]["prediction"]["accepted"] > 0
    r = run("chat", small_model, "-n", "16",
            input=f"/predict {tmp_path / 'nope.txt'}\n/predict {pred}\nSay hello.\n/exit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "cannot read /predict" in r.stderr and "the next reply drafts from" in r.stderr
    assert "prediction" in r.stderr.split("the next reply drafts from")[1]   # its stats line


@pytest.mark.model
def test_chat_answers_before_the_costs_are_measured(small_model, tmp_path):
    # a fresh home: no cost table for the pair. The first reply does not wait for one: it
    # drafts from the context at safe prices and says so; the measurement runs between turns
    env = dict(ENV, SPECEE_CPP_HOME=str(tmp_path / "home"))
    p = subprocess.Popen(CLI + ["chat", str(small_model), "--draft", str(small_model), "-n",
                                "12", "--verbose"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        p.stdin.write("Hello!\n")
        p.stdin.flush()
        # the user reads the reply: idle time for the measurement. The first estimate takes
        # seconds on a quiet machine and far longer on a busy one: wait for its end, not a time
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(iter(p.stderr.readline, "")),
                                  daemon=True)
        reader.start()
        deadline = time.time() + 240
        while (time.time() < deadline and p.poll() is None
               and "measuring this machine's draft/verify costs" not in "".join(seen)):
            time.sleep(0.2)
        if p.poll() is None:
            p.stdin.write("/exit\n")
            p.stdin.flush()
        p.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    stderr = "".join(seen)
    assert p.returncode == 0 and "Traceback" not in stderr, stderr
    assert "costs are not measured yet" in stderr, stderr
    before, after = stderr.split("costs are not measured yet", 1)
    assert "measuring this machine's draft/verify costs" in after, stderr   # after the reply
    # nor for the decode kernels: timed first in idle time, before any cost, and kept
    assert "decode kernels for" not in before and "decode kernels for" in after, stderr
    assert after.index("decode kernels for") < after.index("estimating this machine's"), stderr
    assert list((tmp_path / "home" / "costs").glob("decode-kernels-*.json"))


def test_models_and_doctor():
    r = run("models")
    assert r.returncode == 0 and "qwen2.5-coder-1.5b" in r.stdout and "pair default" in r.stdout
    r = run("doctor")
    assert r.returncode == 0, r.stdout
    assert "present, version" in r.stdout and "CPU features" in r.stdout


def test_pull_unknown_name():
    assert_one_line_error(run("pull", "nope"), "unknown model 'nope'")


def test_chat_over_stdin(small_model):
    r = run("chat", small_model, "-n", "12", input="Hello!\nWhat is 1+1?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") >= 2
    assert r.stderr.count("tok/s") == 2


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_chat_ctrl_c_stops_reply_not_session(small_model):
    # A runner started in the background (as CI may be) passes SIGINT on as ignored, and
    # Python then installs no KeyboardInterrupt handler: give the child the default back.
    p = subprocess.Popen(CLI + ["chat", str(small_model), "-n", "2000"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdin.write("Write a very long story about a dragon.\n")
        p.stdin.flush()
        # wait until the reply is streaming: the prompt marker, then some text
        got = ""
        deadline = time.time() + 120
        while len(got) < 40 and time.time() < deadline:
            c = p.stdout.read(1)
            if not c:
                break  # the process ended
            got += c
        assert len(got) >= 40, (got, p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGINT)
        p.stdin.write("/exit\n")
        p.stdin.flush()
        rest, errs = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, errs
    assert "reply stopped" in errs and "Traceback" not in errs


@pytest.mark.model
def test_profile_fit_controller_and_gamma_auto(small_model, tmp_path):
    """The controller workflow as a user runs it: profile -> fit-controller -> --gamma auto."""
    prompts = tmp_path / "dev.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in [
        ("coding", "Write a Python function that sums a list."),
        ("qa", "Name three colours of the rainbow."),
        ("math_reasoning", "What is 12 times 7? Explain step by step.")]))
    prof = tmp_path / "prof.jsonl"
    r = run("profile", small_model, "--draft", small_model, "--prompts", prompts, "-o", prof,
            "--gammas", "1,8", "--n-prompts", "0", "--per-category", "1", "-n", "32")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in prof.read_text().splitlines()]
    assert {x["gamma"] for x in recs} <= {1, 8} and all(x["target_bpw"] > 4 for x in recs)
    ctl = tmp_path / "ctl.npz"
    r = run("fit-controller", prof, "--draft", small_model, "--target", small_model, "-o", ctl)
    assert r.returncode == 0, r.stderr
    assert ctl.is_file() and "acceptance-rate MAE" in r.stderr
    r = run("generate", small_model, "--draft", small_model, "--mode", "spec", "--gamma", "auto",
            "--controller", ctl, "-p", "def add(a, b):", "--raw", "-n", "16", "--json")
    assert r.returncode == 0, r.stderr
    plain = run("generate", small_model, "-p", "def add(a, b):", "--raw", "-n", "16", "--json")
    assert json.loads(r.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    # `auto` may well decode plainly on this CPU, which makes that equality hold by
    # construction: drafting for real, with a draft that is often rejected (Q2_K of the
    # target), must give the same tokens through the CLI too
    rough = tmp_path / "rough"
    q = run("quantize", small_model, "--types", "Q2_K", "--out-dir", rough)
    assert q.returncode == 0, q.stderr
    draft = next(rough.glob("*.Q2_K.gguf"))
    r = run("generate", small_model, "--draft", draft, "--mode", "spec", "--gamma", "3",
            "-p", "def add(a, b):", "--raw", "-n", "16", "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    assert spec["tokens"] == json.loads(plain.stdout)["tokens"]
    assert spec["stats"]["n_drafted"] > spec["stats"]["n_accept"] > 0  # drafted, some rejected
    assert spec["stats"]["drafted_by_source"] == {
        "model": {"drafted": spec["stats"]["n_drafted"], "accepted": spec["stats"]["n_accept"]}}
    assert spec["stats"]["note"].startswith(f"draft {draft.name}, gamma 3")
    # with a draft and no --mode the cost-aware spec mode runs; this draft has no fitted
    # controller, so it decodes plainly and says why on the stats line
    r = run("generate", small_model, "--draft", draft, "-p", "def add(a, b):", "--raw", "-n",
            "16", "--json")
    doc = json.loads(r.stdout)
    assert doc["mode"] == "spec" and doc["tokens"] == json.loads(plain.stdout)["tokens"]
    assert "no draft-length controller" in doc["stats"]["note"]
    # after the answer one line by default: tokens, speed, the share of drafts kept
    r = run("generate", small_model, "--draft", draft, "--gamma", "2", "-p", "hi", "-n", "8")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 0 and "tok/s" in line and "drafted kept" in line, r.stderr
    assert f"draft {draft.name}" not in r.stderr and len(line) < 80
    # the detail under --verbose: who drafted, and what the mode chose and why
    r = run("generate", small_model, "--draft", draft, "--gamma", "2", "-p", "hi", "-n", "8",
            "--verbose")
    assert "drafted" in r.stderr and f"draft {draft.name}, gamma 2" in r.stderr
    assert "all from the model" in r.stderr
    assert_one_line_error(run("generate", small_model, "--draft", small_model, "--mode", "spec",
                              "--gamma", "often", "-p", "x"), "gamma must be a number of tokens")


def test_costs_says_what_would_make_drafting_pay(tiny_qwen2):
    # the cost table of a pair, and for each acceptance the dearest draft token that would
    # still pay (where a goal is out of reach, the table shows what would reach it)
    r = run("costs", tiny_qwen2, "--draft", tiny_qwen2)
    assert r.returncode == 0, r.stderr
    assert "pays with a draft token up to" in r.stdout
    assert "this draft (" in r.stderr and "of a target token) pays" in r.stderr
    # the draft's attention as chosen, with what was timed (contexts cut to the context)
    assert re.search(r"draft attention: flash attention (off|at llama.cpp default) \(a draft "
                     r"token [\d.]+/[\d.]+ ms with the default, [\d.]+/[\d.]+ ms off, at "
                     r"128/\d+ tokens of context\)", r.stderr.replace("\n", " ")), r.stderr

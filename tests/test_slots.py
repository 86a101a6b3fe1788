"""Several generations in one context (engine/slots.py): each slot's greedy output equals the
same request decoded alone, token for token, while their rows share each step's batch."""
from __future__ import annotations

import threading

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.engine.slots import slots
from specee_cpp.errors import SpeceeError

PROMPTS = ["Write one sentence about the sea.",
           "List three colours of the rainbow.",
           "Count from one to ten in words. " * 6,       # fed in chunks: longer than one
           "Name a famous painter and one painting."]
N = 24


@pytest.fixture(scope="module")
def shared(small_model):
    with LLM(small_model, config=LoadConfig(n_ctx=512, n_threads=2, n_seq=4)) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(small_model):
    """Each prompt's greedy answer (text, tokens) decoded alone, in a context of one
    sequence."""
    with LLM(small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as llm:
        return [llm.generate(p, max_tokens=N) for p in PROMPTS]


def _run(view, prompt, out, decoder, started=None, wait=None, stop_after=None):
    """A slot thread: generate ``prompt`` on ``view`` (after ``wait`` is set), recording its
    tokens; ``stop_after``: close the stream after that many (a client that left)."""
    if wait is not None:
        wait.wait()
    decoder.enter()
    try:
        steps = view.stream(prompt, max_tokens=N)
        try:
            for step in steps:
                out.append(step.token)
                if started is not None and len(out) == 4:
                    started.set()
                if stop_after is not None and len(out) == stop_after:
                    break
        finally:
            steps.close()
    finally:
        decoder.leave()


def test_slots_decode_in_one_batch_and_each_equals_its_request_alone(shared, alone):
    """Four slots; the fourth request arrives while the others are mid-answer. Every answer
    is its alone answer token for token, and the steps carried several slots' rows."""
    decoder, views = slots(shared)
    assert len(views) == 4 and views[0].n_ctx == 512
    outs = [[] for _ in PROMPTS]
    started = threading.Event()
    threads = [threading.Thread(target=_run, args=(views[i], PROMPTS[i], outs[i], decoder),
                                kwargs={"started": started if i == 0 else None})
               for i in range(3)]
    threads.append(threading.Thread(target=_run, args=(views[3], PROMPTS[3], outs[3], decoder),
                                    kwargs={"wait": started}))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outs == [r.tokens for r in alone]
    # alone: a step per token (the prompts' chunks aside); together: far fewer
    assert decoder.steps < 2 * N + 6, decoder.steps


def test_a_slot_that_stops_leaves_the_others_exact_and_its_cache_reusable(shared, alone):
    decoder, views = slots(shared)
    outs = [[] for _ in PROMPTS]
    threads = [threading.Thread(target=_run, args=(views[i], PROMPTS[i], outs[i], decoder),
                                kwargs={"stop_after": 5 if i == 1 else None})
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outs[0] == alone[0].tokens and outs[2] == alone[2].tokens
    assert outs[1] == alone[1].tokens[:5]
    # the stopped slot runs another request next, exactly; nothing of the others' remains
    again: list[int] = []
    _run(views[1], PROMPTS[0], again, decoder)
    assert again == alone[0].tokens


def test_a_slot_reads_every_row_of_a_batch_where_it_stood(shared, alone):
    """Two slots verify their answers at once (every row's output, as a teacher-forced pass
    or a verification reads them), in one step: each row's greedy token is the next token
    of its own answer."""
    decoder, views = slots(shared)
    got: dict[int, list[int]] = {}

    prompts = [shared.prompt_tokens(PROMPTS[i]) for i in (0, 1)]

    def verify(i):
        try:
            seq = views[i].tgt.seq
            seq.prefill(prompts[i], read=False)
            got[i] = seq.decode_greedy(alone[i].tokens[:8])
        finally:
            decoder.leave()

    threads = [threading.Thread(target=verify, args=(i,)) for i in (0, 1)]
    for _ in threads:
        decoder.enter()     # both in use before either decodes: every step waits for both
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == {i: alone[i].tokens[1:9] for i in (0, 1)}
    # the prompts' chunks side by side, then one step for both verifications
    chunks = max(-(-len(p) // views[0].tgt.ctx.n_batch) for p in prompts)
    assert decoder.steps == chunks + 1


def test_a_slot_refuses_what_cannot_share_a_step(shared):
    _, views = slots(shared)
    with pytest.raises(SpeceeError, match="staged decode"):
        views[0].tgt.ctx.stage_begin(None)
    with pytest.raises(SpeceeError, match="draft model is not run in a slot"):
        views[0].dft
    with pytest.raises(SpeceeError, match="sequences must be positive"):
        LoadConfig(n_seq=0)


@pytest.mark.model
def test_serve_parallel_answers_concurrent_clients_as_alone(small_model, alone):
    """`serve --parallel 3`: three clients at once get their alone answers; what a slot
    cannot run is a 400 naming the field; a draft with --parallel is one line at start."""
    import json
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    openai = pytest.importorskip("openai")
    cli = [sys.executable, "-m", "specee_cpp.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    bad = subprocess.run(cli + ["serve", str(small_model), "--parallel", "2", "--draft",
                                str(small_model), "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "--parallel 2 decodes plainly" in bad.stderr
    assert "Traceback" not in bad.stderr
    p = subprocess.Popen(cli + ["serve", str(small_model), "--parallel", "3", "--port", "0",
                                "--n-ctx", "512", "--threads", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "3 slots" in line, line + p.stderr.read()
        url = line.split()[-1]
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        answers: dict[int, str] = {}

        def ask(i):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[i]}],
                max_tokens=N, temperature=0)
            answers[i] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert answers == {i: alone[i].text for i in range(3)}
        health = json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/health").read())
        assert health["slots"] == 3 and health["served"] == 3
        for body, field in (({"specee": {"mode": "ee"}}, "specee.mode"),
                            ({"prediction": {"type": "content", "content": "x"}}, "prediction")):
            req = urllib.request.Request(
                url + "/chat/completions", method="POST",
                data=json.dumps({"model": "m", "max_tokens": 2, **body,
                                 "messages": [{"role": "user", "content": "hi"}]}).encode(),
                headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            err = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and err["param"] == field
            assert "not served with --parallel 3" in err["message"]
    finally:
        p.terminate()
        _, stderr = p.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr

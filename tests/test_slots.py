"""Several generations in one context (engine/slots.py): each slot's greedy output equals the
same request decoded alone, token for token, while their rows share each step's batch."""
from __future__ import annotations

import gc
import os
import threading
import time

from pathlib import Path

import numpy as np
import pytest

from specee_cpp.config import SLOT_STEP, LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.engine.slots import SharedDecoder, slots
from specee_cpp.errors import SpeceeError
from specee_cpp.speculative.mode import SpecOptions, draft_policy

PROMPTS = ["Write one sentence about the sea.",
           "List three colours of the rainbow.",
           "Count from one to ten in words. " * 6,       # over several steps: > SLOT_STEP
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


@pytest.fixture(scope="module")
def rough_draft(small_model, tmp_path_factory) -> Path:
    """The same weights requantized to Q2_K: one tokenizer, but a draft that is often wrong,
    so that verification rejects and rolls back for real."""
    from specee_cpp.bindings.quantize import quantize

    return quantize(small_model, "Q2_K", tmp_path_factory.mktemp("rough-draft"),
                    n_threads=2)[0]


@pytest.fixture(scope="module")
def drafting(small_model, rough_draft):
    """Four slots that run the draft model, a sequence of its context each."""
    with LLM(small_model, draft=rough_draft,
             config=LoadConfig(n_ctx=512, n_threads=2, n_seq=4)) as llm:
        yield llm


def _run(view, prompt, out, decoder, started=None, wait=None, stop_after=None, stats=None,
         max_tokens=N, **kw):
    """A slot thread: generate ``prompt`` on ``view`` (after ``wait`` is set), recording its
    tokens (and in ``stats`` the last step's statistics); ``stop_after``: close the stream
    after that many (a client that left); ``kw``: the mode and prediction."""
    if wait is not None:
        wait.wait()
    decoder.enter()
    try:
        steps = view.stream(prompt, max_tokens=max_tokens, **kw)
        try:
            for step in steps:
                if stats is not None and step.stats is not None:
                    stats.append(step.stats)
                if step.finish_reason == "stop":    # an end-of-generation token: not output
                    break
                out.append(step.token)
                if started is not None and len(out) == 4:
                    started.set()
                if stop_after is not None and len(out) == stop_after:
                    break
        finally:
            steps.close()
    finally:
        decoder.leave()
        if started is not None:   # a slot that failed early lets the one waiting on it go
            started.set()


def _together(threads: list[threading.Thread]) -> None:
    """Start the slot threads, then wait for all of them."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)


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
    _together(threads)
    assert outs == [r.tokens for r in alone]
    # alone: a step per token (the prompts' chunks aside); together: far fewer
    assert decoder.steps < 2 * N + 6, decoder.steps


def test_a_slot_that_stops_leaves_the_others_exact_and_its_cache_reusable(shared, alone):
    decoder, views = slots(shared)
    outs = [[] for _ in PROMPTS]
    threads = [threading.Thread(target=_run, args=(views[i], PROMPTS[i], outs[i], decoder),
                                kwargs={"stop_after": 5 if i == 1 else None})
               for i in range(3)]
    _together(threads)
    assert outs[0] == alone[0].tokens and outs[2] == alone[2].tokens
    assert outs[1] == alone[1].tokens[:5]
    # the stopped slot runs another request next, exactly; nothing of the others' remains
    again: list[int] = []
    _run(views[1], PROMPTS[0], again, decoder)
    assert again == alone[0].tokens


def test_slots_that_draft_and_verify_each_equal_plain_decoding_alone(shared, alone):
    """Four slots verify drafts in shared steps, their rejected rows cut from the cache while
    the others decode: a matching, a partly matching and an unrelated prediction, and mode
    spec's drafts from the context, the last request arriving mid-stream. Every answer is
    its plain answer alone, token for token; then each request again in another slot, in
    the cache the first round left."""
    decoder, views = slots(shared)
    texts = [r.text for r in alone]
    kws = [{"prediction": texts[0]},
           {"prediction": texts[1][:12] + " and something else " + texts[1][12:]},
           {"prediction": "Bananas ride trains to the moon every other Tuesday."},
           {"mode": "spec"}]
    for shift in (0, 1):     # then each request in another slot, in the cells left there
        outs, stats = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
        started = threading.Event()
        threads = [threading.Thread(target=_run, args=(views[(i + shift) % 4], PROMPTS[i],
                                                       outs[i], decoder),
                                    kwargs={"started": started if i == 0 else None,
                                            "wait": started if i == 3 else None,
                                            "stats": stats[i], **kws[i]})
                   for i in range(4)]
        _together(threads)
        assert outs == [r.tokens for r in alone]
        drafted = [sum(d for d, _ in s[-1].by_source.values()) for s in stats]
        kept = [sum(a for _, a in s[-1].by_source.values()) for s in stats]
        # the whole answer as the prediction: drafted and kept; the others: rows rejected
        assert kept[0] >= N // 2 and sum(drafted) > sum(kept), (drafted, kept)


def test_slots_that_run_the_draft_model_each_equal_plain_decoding_alone(drafting, alone):
    """Four slots draft with the draft model at gamma 3, each on its own sequence of the
    draft's context, the draft's rows batched across the slots as the target's are: one
    with a prediction too, one that stops after five tokens, the last arriving mid-stream.
    Every answer is its plain answer alone, token for token (the stopped one its first
    five); then each request again in another slot, in the cells the first round left.
    Each slot's draft drafts what it drafts for the request alone in the server: it reads
    its own sequence of the draft's cache."""
    assert drafting.slots_draft
    decoder, views = slots(drafting)
    assert decoder.draft_ctx is drafting.dft.ctx
    kws = [{"mode": "spec", "gamma": 3, **({"prediction": alone[1].text} if i == 1 else {})}
           for i in range(4)]
    drafted_alone = []
    for i in range(4):
        one: list = []
        _run(views[0], PROMPTS[i], [], decoder, stats=one, **kws[i])
        drafted_alone.append(one[-1].by_source)
    for shift in (0, 1):
        outs, stats = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
        started = threading.Event()
        threads = [threading.Thread(
            target=_run, args=(views[(i + shift) % 4], PROMPTS[i], outs[i], decoder),
            kwargs={"started": started if i == 0 else None,
                    "wait": started if i == 3 else None,
                    "stop_after": 5 if i == 2 else None, "stats": stats[i], **kws[i]})
            for i in range(4)]
        before, before_draft = decoder.steps, decoder.draft_steps
        _together(threads)
        assert outs == [r.tokens if i != 2 else r.tokens[:5] for i, r in enumerate(alone)]
        by = [s[-1].by_source for s in stats if s]
        drafted = sum(d for b in by for d, _ in [b.get("model", (0, 0))])
        kept = sum(a for b in by for _, a in [b.get("model", (0, 0))])
        # the draft drafted, and rows were rejected and cut from both caches
        assert 0 < kept < drafted, by
        # each slot's draft read its own sequence: it drafted and had kept what it does for
        # the request alone
        assert [stats[i][-1].by_source for i in (0, 1, 3)] == \
            [drafted_alone[i] for i in (0, 1, 3)]
        assert "prediction" in stats[1][-1].by_source
        # the draft's decodes were batched across the slots, as the target's were
        assert decoder.draft_steps - before_draft < drafted, (decoder.draft_steps, drafted)
        assert decoder.steps - before < 2 * N + 6


def test_a_slot_at_gamma_0_drafts_from_the_prediction_alone(shared, alone):
    """gamma 0 in a slot of a server without a draft model: no model drafts, the
    prediction's drafts are verified, the answer is plain's alone."""
    decoder, views = slots(shared)
    out, stats = [], []
    _run(views[0], PROMPTS[0], out, decoder, stats=stats, mode="spec", gamma=0,
         prediction=alone[0].text)
    assert out == alone[0].tokens
    by = stats[-1].by_source
    assert set(by) == {"prediction"} and by["prediction"][1] >= N // 2, by


def test_a_slot_drafts_as_long_as_a_step_verifies(drafting):
    """A slot's longest draft fills one step: at gamma SLOT_STEP - 1 (room for it left in
    max_tokens) the draft model's rounds are verified in a step's every row, and the answer
    is plain's in that server (its first 4 tokens: each round drafts 63 tokens, mostly
    rejected); a longer gamma is refused before a token, where no step could hold it."""
    decoder, views = slots(drafting)
    with pytest.raises(SpeceeError, match=f"gamma {SLOT_STEP} does not fit a step of the "
                                          f"slots of --parallel 4"):
        views[0].stream(PROMPTS[1], mode="spec", gamma=SLOT_STEP)
    with pytest.raises(SpeceeError, match=rf"gamma must be in \[0, {SLOT_STEP}\)"):
        draft_policy(views[0], SpecOptions(gamma=SLOT_STEP))
    plain, out = [], []
    _run(views[0], PROMPTS[1], plain, decoder, max_tokens=2 * SLOT_STEP, stop_after=4,
         mode="plain")
    before = decoder.draft_steps
    _run(views[1], PROMPTS[1], out, decoder, max_tokens=2 * SLOT_STEP, stop_after=4,
         mode="spec", gamma=SLOT_STEP - 1)
    assert out == plain and len(plain) == 4
    # the draft decodes a token a step (one slot): whole rounds of SLOT_STEP - 1 were drafted
    assert decoder.draft_steps - before >= SLOT_STEP - 1, decoder.draft_steps - before


def test_a_step_decodes_the_draft_s_waiting_slots_then_the_target_s():
    """A slot drafting waits on the draft's context while another waits on the target's:
    neither waits for the other, one step decodes both batches, the draft's first."""
    order = []

    class Named(_Recorder):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def decode(self, batch):
            super().decode(batch)
            order.append(self.name)

    tgt, dft = Named("target"), Named("draft")
    decoder = SharedDecoder(tgt, draft_ctx=dft)

    def slot(i: int, ctxs) -> None:
        for k, ctx in enumerate(ctxs):
            decoder.decode(i, [(1, k, i, True)], ctx=ctx)
        decoder.leave(i)

    decoder.enter()
    decoder.enter()
    _together([threading.Thread(target=slot, args=(0, [dft, dft, tgt])),
               threading.Thread(target=slot, args=(1, [tgt, tgt, tgt, tgt]))])
    assert dft.steps == [[0], [0]] and [sorted(r) for r in tgt.steps] == \
        [[1], [1], [0, 1], [1]], (dft.steps, tgt.steps)
    assert order == ["draft", "target", "draft", "target", "target", "target"]
    assert decoder.steps == 4 and decoder.draft_steps == 2


def test_a_slot_reuses_its_cells_answer_after_answer(shared, alone):
    """Twenty answers in one slot, each with an unrelated prediction (drafted rows rejected
    and cut) on the cache the last one left: more tokens than the slot's range of cells
    holds, every answer exact. A cell not freed would fill the range: the cache stays
    bounded however long a slot serves."""
    decoder, views = slots(shared)
    cells = shared.tgt.ctx.n_ctx // shared.tgt.n_seq
    written = 0
    for k in range(20):
        out, stats = [], []
        _run(views[0], PROMPTS[k % 4], out, decoder, stats=stats,
             prediction="Bananas ride trains to the moon every other Tuesday.")
        assert out == alone[k % 4].tokens
        written += stats[-1].n_prompt + len(out)
    assert written > 2 * cells, written


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_slots_hold_no_more_memory_answer_after_answer(shared, alone):
    """A server runs for days: four slots answering round after round (plain, context
    drafts, a matching and an unrelated prediction) end holding what they held after the
    first rounds. What grows per answer or per token (a step's logits kept, a drafter's
    trie or a prediction never let go) shows as megabytes over a few hundred answers."""
    decoder, views = slots(shared)
    kinds = [{}, {"mode": "spec"}, {"mode": "spec", "prediction": alone[2].text},
             {"mode": "spec", "prediction": "Bananas ride trains to the moon."}]

    def round_(r):
        outs = [[] for _ in views]
        threads = [threading.Thread(target=_run, args=(views[i], PROMPTS[(i + r) % 4],
                                                       outs[i], decoder),
                                    kwargs=kinds[(i + r) % 4]) for i in range(4)]
        _together(threads)
        assert outs == [alone[(i + r) % 4].tokens for i in range(4)]

    for r in range(3):
        round_(r)
    gc.collect()
    before = _rss_mib()
    for r in range(3, 19):
        round_(r)
    gc.collect()
    grown = _rss_mib() - before
    assert grown < 8, f"{grown:.1f} MiB more after 64 answers"


def test_a_slot_s_rows_equal_alone_s_bit_for_bit_after_the_others_free_cells(shared,
                                                                            small_model):
    """Slot 1 frees cells that lie before slot 0's last ones (rejected draft rows); slot 0
    then decodes a batch whose logits equal, bit for bit, those of the same tokens decoded
    in a context of its own: a slot's keys stay in position order, in its own range of the
    cache, so attention reads them as alone (not in the freed cells before them)."""
    decoder, views = slots(shared)
    a, b = views[0].tgt.seq, views[1].tgt.seq
    pa, pb = (shared.prompt_tokens(PROMPTS[i]) for i in (0, 1))
    x = shared.prompt_tokens(PROMPTS[3])[:16]

    def decode(seq, tokens, all_outputs=False):
        decoder.enter()
        try:
            seq.decode(tokens, all_outputs=all_outputs)
        finally:
            decoder.leave()

    for seq in (a, b):
        seq.rewind(0)
    decode(a, pa)
    decode(b, pb)
    decode(b, x[:8])
    decode(a, x[:4])
    b.rewind(len(pb))                       # 8 free cells before slot 0's last 4
    decode(a, x[4:16], all_outputs=True)
    got = np.stack([a.logits(i) for i in range(12)])
    with LLM(small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as one:
        seq = one.tgt.seq
        seq.decode(pa)
        seq.decode(x[:4])
        seq.decode(x[4:16], all_outputs=True)
        want = np.stack([seq.logits(i) for i in range(12)])
    assert np.array_equal(got, want), np.abs(got - want).max()


def test_a_cache_keeps_sequences_apart_only_where_their_ranges_fit(shared):
    from specee_cpp.bindings import Batch, Context

    ctx = Context(shared.model, n_ctx=512, n_batch=64, n_threads=2, n_seq_max=2,
                  kv_unified=True)
    try:
        assert not ctx.keep_sequences_apart(ctx.n_ctx)     # two such ranges do not fit
        assert ctx.keep_sequences_apart(ctx.n_ctx // 2)
        batch = Batch(4)
        batch.set([1, 2], 0)
        ctx.decode(batch)
        assert not ctx.keep_sequences_apart(ctx.n_ctx // 2)   # cells already in use
    finally:
        ctx.close()


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
    _together(threads)
    assert got == {i: alone[i].tokens[1:9] for i in (0, 1)}
    # the prompts side by side, filling each step (SLOT_STEP rows), then the verifications
    assert sum(map(len, prompts)) <= 2 * SLOT_STEP - 16
    assert decoder.steps == -(-sum(map(len, prompts)) // SLOT_STEP) + 1


@pytest.mark.model
def test_serve_parallel_with_a_draft_runs_it_in_each_slot(small_model, rough_draft, alone):
    """`serve --parallel 2 --draft D --gamma 3`: two clients at once, one asking for gamma
    2, get their plain answers alone, drafted by the draft model in their slots."""
    import os
    import subprocess
    import sys

    openai = pytest.importorskip("openai")
    p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "serve", str(small_model),
                          "--parallel", "2", "--draft", str(rough_draft), "--gamma", "3",
                          "--port", "0", "--n-ctx", "512", "--threads", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"))
    try:
        line = p.stdout.readline()
        assert "(mode spec, 2 slots)" in line, line + p.stderr.read()
        client = openai.OpenAI(base_url=line.split()[-1], api_key="x", max_retries=0,
                               timeout=120)
        answers: dict[int, tuple] = {}

        def ask(i, extra):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[i]}],
                max_tokens=N, temperature=0, extra_body=extra)
            answers[i] = (r.choices[0].message.content, r.model_extra["specee"])

        _together([threading.Thread(target=ask, args=(0, None)),
                   threading.Thread(target=ask, args=(1, {"specee": {"gamma": 2}}))])
        assert {i: a[0] for i, a in answers.items()} == {i: alone[i].text for i in range(2)}
        for i, gamma in ((0, 3), (1, 2)):
            said = answers[i][1]
            assert said["n_drafted"] > 0 and f"draft {rough_draft.name}, gamma {gamma}" \
                in said["note"], said
        # a draft no step holds: refused before a token, naming the field
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=N, extra_body={"specee": {"gamma": SLOT_STEP}})
        err = e.value.body
        assert err["param"] == "specee.gamma" and "does not fit a step" in err["message"], err
    finally:
        p.terminate()
        _, stderr = p.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr


class _Recorder:
    """A context that only records each step: its rows' sequence ids, in batch order."""
    n_batch = 512

    def __init__(self):
        self.steps = []

    def decode(self, batch):
        self.steps.append([seq for _, _, seq, _ in batch.rows()])


def test_a_step_holds_the_lock_that_cache_edits_take():
    """A slot that has left the steps may still cut its cache while the others' step runs:
    the step holds the decoder's lock, which cache edits take, so the edit waits for it."""
    held = []

    class Held(_Recorder):
        def decode(self, batch):
            held.append(decoder.lock.locked())

    decoder = SharedDecoder(Held())
    decoder.enter()
    decoder.decode(0, [(1, 0, 0, True)])
    decoder.leave()
    assert held == [True]


def test_every_step_runs_on_one_thread_that_is_no_slot_s(monkeypatch):
    """Each thread that runs a decode gets an OpenMP team of its own, and more teams than
    cores slow every decode: the steps run on one thread, never on a slot's (so a slot whose
    answer ended leaves at once), with steps of both slots and of the one left; the thread
    ends once no slot is in use, and the next slot in use starts another."""
    from specee_cpp.engine import slots as slots_module

    monkeypatch.setattr(slots_module, "STEPPER_IDLE_S", 0.05)
    ran_on = []

    class Where(_Recorder):
        def decode(self, batch):
            super().decode(batch)
            ran_on.append(threading.current_thread().name)

    ctx = Where()
    decoder = SharedDecoder(ctx)

    def slot(i: int, n: int) -> None:
        for k in range(n):
            decoder.decode(i, [(1, k, i, True)])
        decoder.leave(i)

    decoder.enter()
    decoder.enter()
    _together([threading.Thread(target=slot, args=(i, n), name=f"slot-{i}")
               for i, n in ((0, 2), (1, 5))])
    assert [sorted(s) for s in ctx.steps] == [[0, 1], [0, 1], [1], [1], [1]]
    assert set(ran_on) == {"specee-cpp-steps"}
    first = decoder._stepper
    first.join(timeout=30)
    assert decoder._stepper is None
    decoder.enter()
    slot(0, 1)
    assert ctx.steps[-1] == [0] and ran_on[-1] == "specee-cpp-steps"
    assert decoder._stepper is not first


@pytest.mark.parametrize("ahead", [512, 64])
def test_a_new_prompt_goes_first_then_lets_the_others_go_first(ahead):
    """Slots 1 and 2 wait with 3 rows each when slot 0's prompt of 160 rows arrives: its rows
    go first in each step, until ``ahead`` of them went ahead of the others; then the others
    go first for a step, the prompt filling the room they leave."""
    ctx = _Recorder()
    decoder = SharedDecoder(ctx, prompt_ahead=ahead)

    def prompt():
        rows = [(1, p, 0, p == 159) for p in range(160)]
        while rows:
            _, n = decoder.decode(0, rows, divisible=True)
            rows = rows[n:]
        decoder.leave()

    def decodes(slot):
        for p in range(4):
            decoder.decode(slot, [(1, p, slot, True)] * 3)
        decoder.leave()

    for _ in range(3):
        decoder.enter()
    threads = [threading.Thread(target=decodes, args=(i,)) for i in (1, 2)]
    for waiting, t in enumerate(threads, 1):
        t.start()
        while len(decoder._waiting) < waiting:
            time.sleep(0.001)       # slot 1 waits, then slot 2: the order they came in
    threads.append(threading.Thread(target=prompt))
    threads[-1].start()
    for t in threads:
        t.join(timeout=30)
    first = ctx.steps[:3]
    if ahead == 512:
        assert first[:2] == [[0] * 64] * 2
        assert first[2][:32] == [0] * 32 and sorted(first[2][32:]) == [1] * 3 + [2] * 3
    else:
        assert first == [[0] * 64, [1] * 3 + [2] * 3 + [0] * 58, first[2]], first
        assert first[2][:38] == [0] * 38 and sorted(first[2][38:]) == [1] * 3 + [2] * 3
    assert sum(map(len, ctx.steps)) == 160 + 2 * 4 * 3


@pytest.mark.parametrize("verifiers", [1, 2])
def test_a_prompt_goes_first_whole_however_many_prompts_went_before(verifiers):
    """The others' turn comes after ``prompt_ahead`` prompt rows that went ahead of them
    since they last had a step, not since the server started: slot 0 reads a prompt of 300
    rows, answers, then reads one of 400 while each other slot verifies 40 rows a step (two
    such never fit one step); each prompt up to one batch goes whole before the next
    verification."""
    ctx = _Recorder()
    decoder = SharedDecoder(ctx, prompt_ahead=512)
    done = threading.Event()

    def prompt(n, token):
        rows = [(token, p, 0, p == n - 1) for p in range(n)]
        while rows:
            _, k = decoder.decode(0, rows, divisible=True)
            rows = rows[k:]

    def answers():
        prompt(300, 1)
        for p in (300, 301):
            decoder.decode(0, [(1, p, 0, True)])
        prompt(400, 2)
        done.set()
        decoder.leave(0)

    def verifies(slot):
        while not done.is_set():
            decoder.decode(slot, [(3, 0, slot, True)] * 40)
        decoder.leave(slot)

    for _ in range(verifiers + 1):
        decoder.enter()
    threads = [threading.Thread(target=verifies, args=(i,)) for i in range(1, verifiers + 1)]
    threads.append(threading.Thread(target=answers))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    at = [i for i, s in enumerate(ctx.steps) if s.count(0) > 1]
    assert [ctx.steps[i].count(0) for i in at] == [64] * 4 + [44] + [64] * 6 + [16]
    # the second prompt's steps follow one another, with none of the others' rows but in the
    # room its last leaves
    second = ctx.steps[at[5]:at[-1] + 1]
    assert [len(s) for s in second] == [64] * 6 + [16 + 40], [len(s) for s in second]


def test_prompts_that_come_together_are_read_one_after_the_other():
    """Two prompts of 100 rows wait at once: the first to come is read to its end before
    the other's rows take more than the room it leaves, so its first token waits for its
    own rows only (prompts that took turns would both wait for all 200)."""
    ctx = _Recorder()
    decoder = SharedDecoder(ctx)

    def prompt(slot):
        rows = [(1, p, slot, False) for p in range(100)]
        while rows:     # in batches of 64 with the last row's logits, as a Sequence feeds it
            chunk = rows[:63] + [rows[63][:3] + (True,)] if len(rows) > 64 else rows[:64]
            _, n = decoder.decode(slot, chunk, divisible=True)
            rows = rows[n:]
        decoder.decode(slot, [(2, 100, slot, True)])
        decoder.leave(slot)

    decoder.enter()
    decoder.enter()
    threads = [threading.Thread(target=prompt, args=(i,)) for i in (0, 1)]
    threads[0].start()
    while not decoder._waiting:
        time.sleep(0.001)       # slot 0's prompt came first
    threads[1].start()
    for t in threads:
        t.join(timeout=30)
    # slot 0's answer waits behind slot 1's prompt rows, which go first
    assert ctx.steps == [[0] * 64, [0] * 36 + [1] * 28, [1] * 64, [1] * 8 + [0], [1]], ctx.steps


def test_a_slot_refuses_what_cannot_share_a_step(shared):
    _, views = slots(shared)
    with pytest.raises(SpeceeError, match="staged decode"):
        views[0].tgt.ctx.stage_begin(None)
    with pytest.raises(SpeceeError, match="no draft model runs in this server's slots"):
        views[0].dft
    with pytest.raises(SpeceeError, match="gamma 3 drafts with a draft model, which the "
                                          "slots of --parallel 4 run only where"):
        views[0].stream("hi", mode="spec", gamma=3)
    with pytest.raises(SpeceeError, match="gamma pmin sizes drafts for one request"):
        views[0].stream("hi", mode="spec", gamma="pmin")
    with pytest.raises(SpeceeError, match="history drafts .* not served with --parallel 4"):
        views[0].stream("hi", mode="spec", history=True)
    for n in (0, 257):    # llama.cpp holds at most 256 sequences in a context
        with pytest.raises(SpeceeError, match=rf"sequences must be 1\.\.256, got {n}"):
            LoadConfig(n_seq=n)


@pytest.mark.model
def test_serve_parallel_answers_concurrent_clients_as_alone(small_model, alone):
    """`serve --parallel 3`: three clients at once get their alone answers, one of them
    sending its answer as a prediction (all accepted); what a slot cannot run is a 400
    naming the field; a draft with --parallel is one line at start."""
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
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--draft with --parallel 2: the slots run the draft model at a fixed --gamma N" \
        in " ".join(bad.stderr.split())
    staged = subprocess.run(cli + ["serve", str(small_model), "--parallel", "2", "--mode",
                                   "ee", "--port", "0"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert staged.returncode != 0 and "Traceback" not in staged.stderr
    assert "--mode ee is not served with --parallel 2" in staged.stderr
    fixed = subprocess.run(cli + ["serve", str(small_model), "--parallel", "2", "--gamma", "4",
                                  "--port", "0"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert fixed.returncode != 0 and "Traceback" not in fixed.stderr
    assert "--gamma 4 drafts with a draft model, which the slots of --parallel 2" in \
        " ".join(fixed.stderr.split())
    p = subprocess.Popen(cli + ["serve", str(small_model), "--parallel", "3", "--port", "0",
                                "--n-ctx", "512", "--threads", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "(mode spec, 3 slots)" in line, line + p.stderr.read()   # the default there
        url = line.split()[-1]
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        answers: dict[int, str] = {}

        def ask(i):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[i]}],
                max_tokens=N, temperature=0)
            answers[i] = r.choices[0].message.content

        usage: dict[int, object] = {}

        def predict(i):
            """With its alone answer as the prediction, in mode spec: drafted, verified."""
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[i]}],
                max_tokens=N, temperature=0, extra_body={"specee": {"mode": "spec"}},
                prediction={"type": "content", "content": alone[i].text})
            answers[i] = r.choices[0].message.content
            usage[i] = r.usage.completion_tokens_details

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        threads.append(threading.Thread(target=predict, args=(2,)))
        _together(threads)
        assert answers == {i: alone[i].text for i in range(3)}
        assert usage[2].accepted_prediction_tokens == N and \
            usage[2].rejected_prediction_tokens == 0
        health = json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/health").read())
        assert health["slots"] == 3 and health["served"] == 3
        for specee, param, said in (({"mode": "ee"}, "specee.mode",
                                     "not served with --parallel 3"),
                                    ({"gamma": 4}, "specee.gamma",
                                     "gamma 4 drafts with a draft model")):
            req = urllib.request.Request(
                url + "/chat/completions", method="POST",
                data=json.dumps({"model": "m", "max_tokens": 2, "specee": specee,
                                 "messages": [{"role": "user", "content": "hi"}]}).encode(),
                headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            err = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and err["param"] == param and said in err["message"]
    finally:
        p.terminate()
        _, stderr = p.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr


def test_a_conversation_s_next_turn_goes_back_to_its_slot(shared):
    """The server hands a request to the free slot where it leaves the fewest tokens to read
    again: a conversation's next turn goes back to the slot holding its last turn (its
    history is not read again), though other slots were free longer, and a new conversation
    goes to an empty slot, not over another that starts with the same system prompt."""
    import asyncio

    from specee_cpp.config import SamplingConfig
    from specee_cpp.engine import modes
    from specee_cpp.engine.sequence import common_prefix
    from specee_cpp.server.worker import END, Job, Worker

    plain = modes.get("plain")
    worker = Worker(shared, max_queue=4)

    cached = []

    async def turn(prompt: list[int]) -> tuple[int, list[int]]:
        job = Job(prompt=prompt, max_tokens=8, sampling=SamplingConfig(), stops=(),
                  mode=plain, options=plain.options())
        worker.submit(job)
        out, last = [], None
        while (item := await job.events.get()) is not END:
            if isinstance(item, BaseException):
                raise item
            out.append(item.token)
            last = item
        cached.append(last.stats.n_cached)
        return job.slot, out

    async def talk() -> list[int]:
        a, b = (shared.prompt_tokens(p) for p in PROMPTS[2:0:-1])
        # the chat template's system prompt, shorter than the rest of a's turn
        assert 10 < common_prefix(a, b) < len(a) // 2
        slot_a, out_a = await turn(a)
        slot_b, out_b = await turn(b)
        new = shared.model.tokenize(" And then?", add_special=False, parse_special=False)
        again_a, _ = await turn(a + out_a + new)
        again_b, _ = await turn(b + out_b + new)
        return [slot_a, slot_b, again_a, again_b]

    try:
        slot_a, slot_b, again_a, again_b = asyncio.run(talk())
    finally:
        worker.close()
    assert slot_b != slot_a
    assert (again_a, again_b) == (slot_a, slot_b)
    # each next turn read only what its conversation's last turn had not
    n_a, n_b = (len(shared.prompt_tokens(p)) for p in PROMPTS[2:0:-1])
    assert cached[0] == cached[1] == 0 and cached[2] > n_a and cached[3] > n_b

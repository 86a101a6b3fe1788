"""This machine's cost table measured in idle time (speculative/idle.py): a measurement taken
one sample at a time resumes where it stopped, also in another process, and gives the table
a measurement in one go gives; a run before it is complete answers at once without the
draft model and says why; once it is complete the next run drafts with it."""
from __future__ import annotations

import json

import pytest

from specee_cpp.config import COST_PROMPT, LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.speculative.cost import (CostModel, CostTable, cache_path, measure_table_steps,
                                         median_table, steady_table_steps, table_from)

pytestmark = pytest.mark.model


@pytest.fixture
def pair(small_model):
    llm = LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2))
    yield llm
    llm.close()


def test_a_stopped_measurement_resumes_where_it_stopped(pair):
    prompt = pair.prompt_tokens(COST_PROMPT)
    tgt, dft = pair.tgt.seq, pair.dft.seq
    whole: dict = {}
    n_whole = sum(1 for _ in measure_table_steps(tgt, dft, prompt, whole, repeats=2))
    state: dict = {}
    steps = measure_table_steps(tgt, dft, prompt, state, repeats=2)
    for _ in range(n_whole // 3):
        next(steps)
    steps.close()
    saved = json.loads(json.dumps(state))          # as a later process reads it back
    rest = sum(1 for _ in measure_table_steps(tgt, dft, prompt, saved, repeats=2))
    assert rest == n_whole - n_whole // 3          # no sample taken twice
    a, b = table_from(whole), table_from(saved)
    assert len(a.points) == len(b.points) == 2
    for p, q in zip(a.points, b.points):
        assert len(p.target_batch_s) == len(q.target_batch_s) == 16
        assert p.long_sizes == q.long_sizes and p.context == q.context
        assert all(t > 0 for t in q.target_batch_s) and q.draft_token_s > 0
    assert len(tgt.tokens) == len(prompt) == len(dft.tokens)   # caches left as measure's


def test_a_verdict_near_its_threshold_is_measured_three_times(pair, monkeypatch):
    from specee_cpp.speculative import cost

    # one sample a size: a noisy table would be measured three times for that reason too
    monkeypatch.setattr(cost, "implausible", lambda table: None)
    prompt = pair.prompt_tokens(COST_PROMPT)
    tgt, dft = pair.tgt.seq, pair.dft.seq
    counts = {}
    for name, verdict in (("far", lambda t: 2.0), ("near", lambda t: 1.05)):
        state: dict = {}
        counts[name] = sum(1 for _ in steady_table_steps(tgt, dft, prompt, state, verdict,
                                                         repeats=1))
        assert len(table_from(state).points) == 2
    assert counts["near"] == 3 * counts["far"]


def test_a_median_table_takes_each_price_s_median():
    def table(x):
        return CostTable([CostModel([x, 2 * x], x / 2, plain_token_s=x, draft_first_s=x,
                                    long_sizes=[24], long_batch_s=[10 * x])])

    m = median_table([table(1.0), table(3.0), table(2.0)]).points[0]
    assert m.target_batch_s == [2.0, 4.0] and m.draft_token_s == 1.0
    assert m.plain_token_s == 2.0 and m.long_batch_s == [20.0] and m.long_sizes == [24]


def test_runs_answer_at_once_and_draft_once_measured_in_idle_time(pair, small_model,
                                                                   monkeypatch):
    from specee_cpp.bindings import Context
    from specee_cpp.speculative.idle import partial_path
    from specee_cpp.speculative.mode import (SpecOptions, cost_key, estimate_key,
                                             estimated_costs, forget_costs, idle_costs_job)

    key, _ = cost_key(pair)
    cache_path(key).unlink(missing_ok=True)
    cache_path(estimate_key(pair)).unlink(missing_ok=True)
    partial_path(key).unlink(missing_ok=True)   # another test's stopped measurement
    forget_costs(pair)
    pair.defer_costs = True
    opts = SpecOptions(gamma="auto")
    plain = pair.generate("def add(a, b):", chat=False, max_tokens=16)
    first = pair.generate("def add(a, b):", chat=False, max_tokens=16, mode="spec",
                          options=opts)
    assert first.tokens == plain.tokens
    assert "not measured yet" in first.stats.note and not cache_path(key).exists()
    assert first.stats.by_source.get("model") is None
    lines: list[str] = []
    idle = idle_costs_job(pair, "spec", opts, log=lines.append)
    assert idle is not None and idle.pending()
    # first an estimate in a few timed steps, cached; runs are priced by it meanwhile
    idle.run(stop=lambda: estimated_costs(pair) is not None)
    assert cache_path(estimate_key(pair)).is_file() and not partial_path(key).exists()
    assert any(line.startswith("first estimate: ") for line in lines), lines
    est = pair.generate("def add(a, b):", chat=False, max_tokens=16, mode="spec",
                        options=opts)
    assert est.tokens == plain.tokens and "first estimate" in est.stats.note
    seen: list[str] = []

    def request_arrives() -> bool:   # once a few of the table's samples are on disk
        seen.append("slice")
        return partial_path(key).is_file() and len(
            json.loads(partial_path(key).read_text())["points"][0].get("plain", [])) >= 3

    closed: list = []
    close = Context.close
    monkeypatch.setattr(Context, "close", lambda ctx: (closed.append(ctx), close(ctx))[1])
    idle.run(stop=request_arrives)
    assert not idle.done and partial_path(key).is_file() and len(seen) > 3
    # the end of the chat: the paused measurement's own context is freed before the models
    n_closed = len(closed)
    idle.close()
    assert len(closed) == n_closed + 1 and idle.pending()
    # another process picks it up where this one stopped
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as other:
        other.defer_costs = True
        later = idle_costs_job(other, "spec", opts, log=lines.append)
        assert later.run(stop=lambda: False) and later.done
        assert any("resuming the cost measurement" in line for line in lines), lines
        assert cache_path(key).is_file() and not partial_path(key).exists()
        res = other.generate("def add(a, b):", chat=False, max_tokens=16, mode="spec",
                             options=opts)
        assert res.tokens == plain.tokens
        assert "not measured yet" not in res.stats.note
        assert "measured while idle" in res.stats.note
        again = other.generate("def add(a, b):", chat=False, max_tokens=16, mode="spec",
                               options=opts)
        assert "measured while idle" not in again.stats.note   # said once
    # a run that finds the table there at its start measured nothing: it says nothing of it
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as third:
        third.defer_costs = True
        assert idle_costs_job(third, "spec", opts) is None
        res = third.generate("def add(a, b):", chat=False, max_tokens=16, mode="spec",
                             options=opts)
        assert res.tokens == plain.tokens and "idle" not in res.stats.note
    pair.defer_costs = False


def test_a_table_disturbed_in_idle_time_prices_the_run_and_is_not_kept(pair, monkeypatch):
    """Where other work disturbed the measurement past its repeats (cost.implausible), the
    run drafts with what was measured, says so, and the next run measures again."""
    from specee_cpp.speculative import idle as idle_module
    from specee_cpp.speculative.cost import as_table
    from specee_cpp.speculative.idle import partial_path
    from specee_cpp.speculative.mode import (SpecOptions, cost_key, forget_costs, idle_costs_job,
                                             measured_costs)

    # the full table (two contexts) reads as disturbed, the first estimate (one) does not
    monkeypatch.setattr(idle_module, "implausible",
                        lambda t: "a batch of 3 measured 0.72" if len(as_table(t).points) > 1
                        else None)
    key, _ = cost_key(pair)
    cache_path(key).unlink(missing_ok=True)
    partial_path(key).unlink(missing_ok=True)
    forget_costs(pair)
    pair.defer_costs = True
    lines: list[str] = []
    try:
        idle = idle_costs_job(pair, "spec", SpecOptions(gamma="auto"), log=lines.append)
        assert idle.run(stop=lambda: False) and idle.done
        assert not cache_path(key).exists() and not partial_path(key).exists()
        assert measured_costs(pair) is not None    # this run drafts with it
        assert any("a batch of 3 measured 0.72), so it is not kept" in line
                   for line in lines), lines
        forget_costs(pair)
        assert measured_costs(pair) is None        # the next run measures again
    finally:
        pair.defer_costs = False

"""How many slots ``serve`` runs where --parallel is not given (server/slot_count.py): the
default count where this machine's timing says a step of it pays and the configuration runs
unchanged in a slot, else one request at a time, with the reason said at start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specee_cpp.config import SLOT_DEFAULT, SLOT_GAIN, LoadConfig
from specee_cpp.engine import modes, slot_step
from specee_cpp.engine.llm import LLM
from specee_cpp.engine.timing import cache_file
from specee_cpp.server import slot_count
from specee_cpp.speculative.mode import SpecOptions

PLAIN, SPEC, EE = modes.get("plain"), modes.get("spec"), modes.get("ee")


def _timing(step_in_plain_tokens: float) -> dict:
    return {"one": 0.03, "step": 0.03 * step_in_plain_tokens, "rows": SLOT_DEFAULT}


@pytest.fixture
def decide(monkeypatch):
    """default_slots on a stand-in for the loaded target (draft or none), the timing and the
    draft's verdict given."""
    def run(step=2.0, draft=False, pays=None, alone=None, in_slot=SPEC, opts=None,
            draft_given=False):
        monkeypatch.setattr(slot_count, "step_timing",
                            lambda llm: (_timing(step), "measured on this machine"))
        monkeypatch.setattr(slot_count, "draft_pays", lambda llm: pays)
        llm = SimpleNamespace(draft_path="draft.gguf" if draft else None)
        alone = alone or (SPEC if draft else PLAIN)
        opts = opts if opts is not None else (SpecOptions() if in_slot is SPEC else
                                              in_slot.Options())
        return slot_count.default_slots(llm, alone, in_slot, opts, draft_given)
    return run


def test_slots_where_a_step_of_them_pays_here(decide):
    n, why = decide(step=2.0)
    assert n == SLOT_DEFAULT and "costs 2.0 one-token steps" in why and "2.0x" in why
    # a step dearer than SLOT_GAIN allows: one at a time
    n, why = decide(step=SLOT_DEFAULT / SLOT_GAIN * 1.05)
    assert n == 1 and f"under {SLOT_GAIN}x" in why


def test_one_at_a_time_where_a_slot_would_change_the_configuration(decide):
    n, why = decide(in_slot=EE)
    assert n == 1 and f"mode ee is not served with --parallel {SLOT_DEFAULT}" in why
    n, why = decide(opts=SpecOptions(gamma=4))
    assert n == 1 and "gamma 4 drafts with a draft model" in why
    n, why = decide(opts=SpecOptions(history=True))
    assert n == 1 and "history drafts from one user's earlier outputs" in why
    n, why = decide(draft_given=True)
    assert n == 1 and "--draft" in why


def test_the_default_pair_s_draft_decides_by_its_measured_worth(decide):
    assert decide(draft=True, pays=None)[0] == 1      # not measured: measured while idle
    assert "not measured yet" in decide(draft=True, pays=None)[1]
    assert decide(draft=True, pays=True)[0] == 1      # a slot would leave it out
    assert decide(draft=True, pays=False)[0] == SLOT_DEFAULT
    # a mode that runs no draft model alone does not ask
    assert decide(draft=True, pays=True, alone=PLAIN)[0] == SLOT_DEFAULT


@pytest.mark.model
def test_the_step_is_timed_once_a_machine_then_read_back(small_model):
    with LLM(small_model, config=LoadConfig(n_ctx=256, n_threads=2)) as llm:
        from specee_cpp.provenance import machine

        cache = cache_file("slot-step", slot_step.VERSION, llm.model.path,
                           machine(llm.config.threads))
        cache.unlink(missing_ok=True)
        seen, source = slot_step.step_timing(llm)
        assert source == "measured on this machine now" and cache.is_file()
        assert seen["rows"] == SLOT_DEFAULT and seen["one"] > 0 and seen["step"] > 0
        again, source = slot_step.step_timing(llm)
        assert again == seen and source == f"measured on this machine ({cache.name})"
    from specee_cpp.doctor import slots_state

    said = slots_state()
    assert f"{small_model.stem[:40]}-{small_model.stat().st_size}: " in said, said
    assert f"a step of {SLOT_DEFAULT} requests gives {slot_step.gain(seen):.1f}x" in said


@pytest.mark.model
def test_the_draft_s_verdict_is_its_cost_table_s(small_model):
    """draft_pays reads the pair's cached table (this machine's key), measuring nothing."""
    from specee_cpp.speculative import simulate
    from specee_cpp.speculative.cost import CostModel, as_table, cache_path, store
    from specee_cpp.speculative.mode import cost_key, forget_costs

    cpu = CostModel([0.034 * x for x in (1.0, 1.68, 2.27, 2.77, 3.5, 4.15, 4.64, 6.44)],
                    draft_token_s=0.6 * 0.034)
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=256, n_threads=2)) as llm:
        key, _ = cost_key(llm)
        cache_path(key).unlink(missing_ok=True)
        forget_costs(llm)
        assert slot_count.draft_pays(llm) is None
        store(key, as_table(simulate.gpu_like(cpu, bpw=4.85)))
        forget_costs(llm)
        assert slot_count.draft_pays(llm) is True
        store(key, as_table(cpu))
        forget_costs(llm)
        assert slot_count.draft_pays(llm) is False
        cache_path(key).unlink()


@pytest.mark.model
def test_serve_says_how_many_slots_it_runs_and_why(small_model):
    """Without --parallel, serve follows this machine's timing of a step (seeded here, so
    the test does not depend on the machine) and says at start what it chose."""
    from specee_cpp.provenance import machine

    cache = cache_file("slot-step", slot_step.VERSION, small_model, machine(2))
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="300")
    try:
        for step, expect, said in ((2.0, f"(mode spec, {SLOT_DEFAULT} slots)",
                                    f"--parallel {SLOT_DEFAULT} (the default here): a step of "
                                    f"{SLOT_DEFAULT} requests costs 2.0 one-token steps"),
                                   (3.9, "(mode plain)", "--parallel 1 (the default here)")):
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(_timing(step)))
            p = subprocess.Popen([sys.executable, "-m", "specee_cpp.cli", "serve",
                                  str(small_model), "--port", "0", "--n-ctx", "256",
                                  "--threads", "2"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
            try:
                line = p.stdout.readline()
            finally:
                p.terminate()
                _, stderr = p.communicate(timeout=30)
            assert expect in line, line + stderr
            assert said in " ".join(stderr.split()), stderr
            assert "Traceback" not in stderr
    finally:
        cache.unlink(missing_ok=True)


@pytest.mark.model
def test_serve_opens_its_slots_or_falls_back_to_one(small_model, monkeypatch):
    """Where slots pay, the loaded target's context is opened again with a sequence a slot
    (its weights loaded once) and the draft let go; where its KV cache cannot keep them
    apart, one request at a time with the draft, saying why."""
    from specee_cpp.bindings import Context
    from specee_cpp.cli import run

    monkeypatch.setattr(slot_count, "step_timing",
                        lambda llm: (_timing(2.0), "measured on this machine"))
    loads = []
    load = run._load
    monkeypatch.setattr(run, "_load", lambda *a, **k: loads.append(load(*a, **k)) or loads[-1])
    config = LoadConfig(n_ctx=256, n_threads=2)
    draft = str(small_model)      # the same vocabulary: a draft the slots let go

    def default_slots():
        return run._default_slots(str(small_model), draft, config, PLAIN,
                                  (SPEC, SpecOptions()), draft_given=False)

    llm, n, why = default_slots()
    with llm:
        assert loads == [llm]
        assert n == SLOT_DEFAULT and llm.tgt.n_seq == SLOT_DEFAULT and llm.draft_path is None
        assert llm.n_ctx == 256 and llm.config.n_seq == SLOT_DEFAULT
    monkeypatch.setattr(Context, "keep_sequences_apart", lambda self, n: False)
    llm, n, why = default_slots()
    with llm:
        assert n == 1 and llm.tgt.n_seq == 1 and "cannot keep 4 sequences apart" in why
        assert llm.draft_path is not None and llm.n_ctx == 256
        assert len(llm.generate("Hi", max_tokens=2).tokens) >= 1   # its context reopened

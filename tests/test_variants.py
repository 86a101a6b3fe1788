"""`--draft NAME:auto`: the draft variant chosen with this machine's costs (spec/variants.py).

Costs are given (the cost model itself is tested in test_cost.py); the variants are real
files made by llama.cpp's quantizer from SmolLM2."""
from __future__ import annotations

import json

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.spec import mode as spec_mode
from specee_cpp.spec import variants
from specee_cpp.spec.cost import CostModel, CostTable


def table(draft: float, verify: list[float]) -> CostTable:
    return CostTable([CostModel(target_batch_s=verify, draft_token_s=draft, plain_token_s=1.0,
                                context=128)])


FLAT = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]       # a GPU-like target
STEEP = [1.0, 1.7, 2.9, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]          # this CPU-like target


@pytest.fixture
def auto_llm(small_model, tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "record_path", lambda sha: tmp_path / "variants.json")
    llm = LLM(small_model, draft="smollm2-135m:auto", config=LoadConfig(n_ctx=512, n_threads=2))
    yield llm
    llm.close()


def write_record(tmp_path, accept: dict) -> None:
    (tmp_path / "variants.json").write_text(json.dumps(
        {"shipped": "Q4_1", "variants": {k: {"acceptance": a} for k, a in accept.items()}}))


def fake_costs(monkeypatch, by_name: dict, seen: list):
    def cost_model(llm):
        seen.append(llm.draft_path.name)
        return by_name[llm.draft_path.name.split(".")[-2]]
    monkeypatch.setattr(spec_mode, "cost_model", cost_model)


def test_auto_starts_from_the_shipped_draft(auto_llm, small_model):
    assert auto_llm.draft_auto == "smollm2-135m" and auto_llm.draft_path == small_model


def test_no_record_keeps_the_shipped_draft(auto_llm, small_model):
    note = spec_mode.choose_variant(auto_llm)
    assert "as shipped (no measured variants" in note and auto_llm.draft_path == small_model


def test_steep_verification_makes_and_measures_nothing(auto_llm, small_model, tmp_path,
                                                       monkeypatch):
    write_record(tmp_path, {"Q4_1": 0.6, "Q8_0": 0.62})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.5, STEEP)}, seen)
    note = spec_mode.choose_variant(auto_llm)
    assert "even a free draft" in note and seen == [small_model.name]
    assert auto_llm.draft_path == small_model


def test_flat_verification_picks_the_fastest_predicted_variant(auto_llm, small_model,
                                                               tmp_path, monkeypatch):
    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.7})
    seen = []
    # the Q8_0 variant drafts at a fifth of the shipped one's cost, same acceptance
    fake_costs(monkeypatch, {"Q4_1": table(0.5, FLAT), "Q8_0": table(0.1, FLAT)}, seen)
    note = spec_mode.choose_variant(auto_llm)
    assert auto_llm.draft_path.name.endswith(".Q8_0.gguf") and auto_llm.draft_path.is_file()
    assert "smollm2-135m:Q8_0, predicted" in note
    # chosen once per LLM: asking again neither measures nor moves
    n = len(seen)
    assert spec_mode.choose_variant(auto_llm) == note and len(seen) == n
    # and the chosen draft is what a speculative run loads and drafts with
    out = auto_llm.generate("The capital of France is", max_tokens=8, mode="spec", gamma=2)
    assert auto_llm.dft.model.path == auto_llm.draft_path and out.stats.n_drafted > 0

"""`--draft NAME:auto`: the draft variant chosen with this machine's costs (speculative/variants.py).

Costs and screening ratios are given in the choice tests (the cost model itself is tested in
test_cost.py, the screening timer below on real files); the variants are real files made by
llama.cpp's quantizer from SmolLM2."""
from __future__ import annotations

import json

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.speculative import mode as spec_mode
from specee_cpp.speculative import variants
from specee_cpp.speculative.cost import CostModel, CostTable


def table(draft: float, verify: list[float], first: float = 0.0) -> CostTable:
    return CostTable([CostModel(target_batch_s=verify, draft_token_s=draft, plain_token_s=1.0,
                                context=128, draft_first_s=first)])


FLAT = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]       # a GPU-like target
STEEP = [1.0, 2.0, 2.9, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]          # verifying 2 costs 2
ZEN5 = [1.0, 1.31, 1.42, 1.57, 1.93, 2.12, 2.36, 2.60, 3.0]    # measured there, sizes 1-9


@pytest.fixture
def auto_llm(small_model, tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "record_path", lambda sha: tmp_path / "variants.json")
    monkeypatch.setattr(variants, "choice_path", lambda llm: tmp_path / "choice.json")
    llm = LLM(small_model, draft="smollm2-135m:auto", config=LoadConfig(n_ctx=512, n_threads=2))
    yield llm
    llm.close()


def write_record(tmp_path, accept: dict) -> None:
    (tmp_path / "variants.json").write_text(json.dumps(
        {"shipped": "Q4_1", "variants": {k: {"acceptance": a} for k, a in accept.items()}}))


def fake_costs(monkeypatch, by_name: dict, seen: list, ratios: dict | None = None):
    """Full tables by the draft file's type; screening ratios (variant draft token over the
    shipped one's) by variant, recorded in ``seen`` as ("screen", spec)."""
    def cost_model(llm):
        seen.append(llm.draft_path.name)
        return by_name[llm.draft_path.name.split(".")[-2]]

    def draft_ratio(llm, path, runs=1):
        spec = path.name.split(".")[-2]
        seen.append(("screen", spec) if runs == 1 else ("screen", spec, runs))
        assert path.is_file()   # made before it is timed
        r = (ratios or {})[spec]
        return r[runs > 1] if isinstance(r, tuple) else r   # (first screening, median of 3)
    monkeypatch.setattr(spec_mode, "cost_model", cost_model)
    monkeypatch.setattr(variants, "draft_ratio", draft_ratio)


def test_auto_starts_from_the_shipped_draft(auto_llm, small_model):
    assert auto_llm.draft_auto == "smollm2-135m" and auto_llm.draft_path == small_model


def test_no_record_keeps_the_shipped_draft(auto_llm, small_model):
    note = spec_mode.choose_variant(auto_llm)
    assert "as shipped (no measured variants" in note and auto_llm.draft_path == small_model


def test_steep_verification_makes_and_measures_nothing(auto_llm, small_model, tmp_path,
                                                       monkeypatch):
    # even at the top work level (0.9 x 0.62 / 0.6) a free draft loses on STEEP
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
    # the Q8_0 variant drafts at a fifth of the shipped one's cost, same acceptance: it is
    # screened (not given a full table), and only the winner's own table is measured
    fake_costs(monkeypatch, {"Q4_1": table(0.5, FLAT), "Q8_0": table(0.1, FLAT)}, seen,
               ratios={"Q8_0": 0.2})
    note = spec_mode.choose_variant(auto_llm)
    assert seen == [small_model.name, ("screen", "Q8_0")]
    assert auto_llm.draft_path.name.endswith(".Q8_0.gguf") and auto_llm.draft_path.is_file()
    assert "smollm2-135m:Q8_0 for this machine (draft token 0.20x, acceptance 1.00x" in note
    # chosen once per LLM: asking again neither measures nor moves
    n = len(seen)
    assert spec_mode.choose_variant(auto_llm) == note and len(seen) == n
    # and the chosen draft is what a speculative run loads and drafts with
    out = auto_llm.generate("The capital of France is", max_tokens=8, mode="spec", gamma=2)
    assert auto_llm.dft.model.path == auto_llm.draft_path and out.stats.n_drafted > 0


def test_the_choice_is_kept_for_every_later_run_on_this_machine(auto_llm, small_model,
                                                                tmp_path, monkeypatch):
    """A choice made in the foreground (`specee-cpp costs`, bench, a script) is what a run
    that does not wait for measurements (chat, generate, serve) finds: it drafts with it
    instead of waiting for idle time to choose again."""
    from specee_cpp.speculative.idle import IdleCosts

    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.7})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.5, FLAT), "Q8_0": table(0.1, FLAT)}, seen,
               ratios={"Q8_0": 0.2})
    note = spec_mode.choose_variant(auto_llm)
    n = len(seen)
    with LLM(small_model, draft="smollm2-135m:auto",
             config=LoadConfig(n_ctx=512, n_threads=2)) as later:
        monkeypatch.setattr(spec_mode, "measured_costs", lambda llm: table(0.1, FLAT))
        assert not IdleCosts(later).pending()       # nothing left to measure or choose
        assert later.draft_path == auto_llm.draft_path
        assert spec_mode.choose_variant(later) == f"{note} (chosen earlier on this machine)"
    assert len(seen) == n   # neither timed nor screened again


def test_a_cheaper_draft_that_loses_acceptance_can_lose(auto_llm, small_model, tmp_path,
                                                        monkeypatch):
    """Cheaper by a third but accepting 40% less: the shipped draft stays."""
    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.42})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.3, FLAT)}, seen, ratios={"Q8_0": 0.66})
    note = spec_mode.choose_variant(auto_llm)
    assert auto_llm.draft_path == small_model and "smollm2-135m:Q4_1 for this machine" in note


def test_a_variant_that_cannot_be_made_is_left_out(auto_llm, small_model, tmp_path,
                                                    monkeypatch):
    """A recorded variant this build cannot make (here a type llama.cpp does not have) is
    skipped with its reason in the note; the others still compete."""
    write_record(tmp_path, {"Q4_1": 0.7, "Q9_9": 0.75, "Q8_0": 0.7})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.5, FLAT)}, seen, ratios={"Q8_0": 0.2})
    note = spec_mode.choose_variant(auto_llm)
    assert auto_llm.draft_path.name.endswith(".Q8_0.gguf")
    assert "not tried: Q9_9: unknown quantization type" in note
    assert ("screen", "Q9_9") not in seen


def test_workload_score_prefers_cheaper_drafts_where_acceptance_is_high():
    """On a CPU-like target where an average prompt's acceptance lets nothing pay, a cheaper
    draft still wins at code-like acceptance: the score spans the work levels."""
    steepish = [1.0, 1.6, 1.75, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4]
    dear, cheap = table(0.43, steepish), variants.scaled_draft(table(0.43, steepish), 0.55)
    assert variants.predicted_speedup(dear, 0.6)[0] == variants.predicted_speedup(cheap, 0.6)[0]
    assert variants.workload_score(cheap, 1.0) > variants.workload_score(dear, 1.0) > 1.0


def test_draft_ratio_times_a_real_variant_once(small_model, tmp_path, monkeypatch):
    """The screen times a real requantized variant against the loaded draft and caches the
    ratio per machine: a second LLM reads it without loading the variant."""
    from specee_cpp.engine.llm import resolve

    q8 = resolve("smollm2-135m:Q8_0")                  # the session's model cache
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path / "home"))   # costs of its own
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as llm:
        r = variants.draft_ratio(llm, q8)
    assert 0.2 < r < 5.0
    cached = list((tmp_path / "home" / "costs").glob("screen-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == {q8.name: r}

    def no_load(*a, **k):
        raise AssertionError("screened again")
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as llm:
        with monkeypatch.context() as m:
            m.setattr("specee_cpp.engine.llm._Loaded", no_load)
            assert variants.draft_ratio(llm, q8) == r
            assert not llm.draft_loaded
        # asked for the median of three screenings, it takes the two missing and keeps all
        steady = variants.draft_ratio(llm, q8, runs=3)
    runs = json.loads(cached[0].read_text())[q8.name]
    assert len(runs) == 3 and runs[0] == r and steady == sorted(runs)[1]


def test_tied_work_scores_go_to_the_variant_that_pays_from_the_lowest_acceptance(
        auto_llm, small_model, tmp_path, monkeypatch):
    """Where nothing pays at the work levels (every score 1.00), the cheaper variant that
    pays at code-like acceptance is chosen, not the shipped draft (on the Zen 5 EPYC the
    shipped draft was kept on such a tie and spec-auto drafted nothing)."""
    # the Zen 5's table (build c763be6b): a draft token 0.67 of a target token, its first
    # (a 2-row catch-up) 1.48, verification of 2-8 as measured; the variant 0.49 of it
    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.58})
    seen = []
    shipped = table(0.67, ZEN5, first=1.48)
    fake_costs(monkeypatch, {"Q4_1": shipped}, seen, ratios={"Q8_0": 0.49})
    cheap = variants.scaled_draft(shipped, 0.49)
    rel = 0.58 / 0.7
    assert variants.workload_score(cheap, rel) == variants.workload_score(shipped, 1.0) == 1.0
    assert variants.pays_from(cheap, rel) < 1.0 and variants.pays_from(shipped, 1.0) == 2.0
    note = spec_mode.choose_variant(auto_llm)
    assert auto_llm.draft_path.name.endswith(".Q8_0.gguf"), note


def test_a_tie_with_nothing_paying_anywhere_keeps_the_shipped_draft(
        auto_llm, small_model, tmp_path, monkeypatch):
    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.4})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.67, ZEN5, first=1.48)}, seen, ratios={"Q8_0": 0.9})
    spec_mode.choose_variant(auto_llm)
    assert auto_llm.draft_path == small_model



def test_a_choice_within_a_screening_s_noise_is_screened_again(auto_llm, small_model,
                                                               tmp_path, monkeypatch):
    """A variant that wins by less than a screening's noise (its draft token 3% cheaper than
    the shipped one's, same acceptance) is screened twice more and judged at the median of
    its three screenings, which here turns the choice; one that wins clearly is screened
    once (test_flat_verification_picks_the_fastest_predicted_variant)."""
    write_record(tmp_path, {"Q4_1": 0.7, "Q8_0": 0.7})
    seen = []
    fake_costs(monkeypatch, {"Q4_1": table(0.5, FLAT)}, seen, ratios={"Q8_0": (0.97, 1.08)})
    note = spec_mode.choose_variant(auto_llm)
    assert seen == [small_model.name, ("screen", "Q8_0"), ("screen", "Q8_0", 3)]
    assert auto_llm.draft_path == small_model, note

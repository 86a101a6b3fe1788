"""Early exit end to end on SmolLM2-135M: calibration, exact fallback, exits reported."""
import json
from dataclasses import replace

import numpy as np
import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.early_exit.mode import EEOptions
from specee_cpp.early_exit.calibrate import CalibConfig, calibrate
from specee_cpp.early_exit.candidates import NgramCandidates
from specee_cpp.early_exit.predictor import Predictors
from specee_cpp.engine.llm import LLM
from specee_cpp.errors import SpeceeError

PROMPTS = [
    "Repeat this list three times: apple, banana, cherry, apple, banana, cherry.",
    "Write a Python function add(a, b) and call add twice.",
    "Count from one to twenty in words.",
    "Spell the word 'banana' letter by letter, then again.",
    "List the days of the week, twice.",
]


@pytest.fixture(scope="module")
def bundle(small_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ee") / "smol.ngram.npz"
    with LLM(small_model, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        report = calibrate(llm, NgramCandidates(k=4), PROMPTS, out,
                           CalibConfig(n_tokens=24, min_layer=18, epochs=20, threshold=0.3,
                                       val_frac=0.4))
    return out, report


def test_calibration_writes_bundle_and_report(bundle, small_model):
    out, report = bundle
    pred = Predictors.load(out)
    assert pred.layers == list(range(18, 29)) and pred.meta["provider"] == "ngram"
    assert set(report["per_layer"]) == set(pred.layers)
    assert json.loads(out.with_suffix(".report.json").read_text())["layers"] == pred.layers
    # records are kept: a rerun resumes without decoding again
    from pathlib import Path

    assert len(list(Path(report["work"]).glob("*.npz"))) == len(PROMPTS)
    # the bundle lists every prompt it saw, and keeps a plan per rule and quality target,
    # each meeting its target on the held-out prompts (quality.choose_plans)
    from specee_cpp.config import EXIT_TARGETS
    from specee_cpp.early_exit.quality import upper_bound

    assert len(pred.meta["prompts"]) == len(PROMPTS)
    assert pred.meta["exit_plans"] == report["exit_plans"]
    for rule in ("argmax", "candidate"):
        plans = report["exit_plans"][rule]
        assert list(plans) == [f"{t:g}" for t in EXIT_TARGETS]
        for t, p in plans.items():
            assert p["tokens"] == report["validation_tokens"]
            assert not p["thresholds"] or upper_bound(p["wrong"], p["exits"]) <= float(t)


def test_held_out_error_measures_only_prompts_the_bundle_did_not_see(bundle, small_llm):
    from specee_cpp.early_exit.calibrate import held_out_error

    out, _ = bundle
    pred = Predictors.load(out)
    fresh = ["Name three colours, then the same three again.", "Write the alphabet backwards."]
    figures = held_out_error(small_llm, NgramCandidates(k=4), pred,
                             [("seen", PROMPTS[0]), ("new", fresh[0]), ("new", fresh[1])],
                             [0.01, 0.9])
    assert figures["prompts"] == 2
    for rule in ("argmax", "candidate"):
        for t in ("0.01", "0.9"):
            f = figures[rule][t]
            assert set(f) == {"all", "new"} and f["all"] == f["new"]
            assert f["all"]["tokens"] > 24 and 0 <= f["all"]["wrong"] <= f["all"]["exits"]
    with pytest.raises(SpeceeError, match="does not list the prompts"):
        held_out_error(small_llm, NgramCandidates(k=4), replace(pred, meta={}),
                       [("new", fresh[0])], [0.01])


def test_threshold_one_reproduces_plain(bundle, small_llm):
    out, _ = bundle
    for prompt in PROMPTS[:3]:
        plain = small_llm.generate(prompt, max_tokens=40)
        # no provider named and no draft loaded: the n-gram candidates
        ee = small_llm.generate(prompt, max_tokens=40, mode="ee",
                                options=EEOptions(predictors=str(out), threshold=1.0))
        assert ee.tokens == plain.tokens
        assert ee.stats.exit_layers == {}


def test_measuring_exit_costs_leaves_no_cells_a_prompt_would_reuse(bundle, small_llm):
    """The cost context shares a chat prompt's first tokens; cells read in its batch would
    make the next answer's near ties go by the measurement, not by the prompt alone."""
    from specee_cpp.early_exit.costs import measure

    out, _ = bundle
    small_llm.generate(PROMPTS[0], max_tokens=4)
    measure(small_llm, Predictors.load(out), repeats=1)
    assert small_llm.tgt.seq.tokens == []


def test_every_exit_is_checked_so_the_output_is_plain_decoding(bundle, small_llm):
    """Exits at a threshold far looser than any quality target's (many of them wrong) are
    each checked at full depth before they are emitted: the output is plain greedy
    decoding's, token for token; confirmed exits are reported, undone ones counted."""
    out, _ = bundle
    opts = EEOptions(provider="ngram", predictors=str(out), threshold=0.05, always=True)
    n_exit = n_checked = n_confirmed = 0
    for prompt in PROMPTS:
        plain = small_llm.generate(prompt, max_tokens=48)
        res = small_llm.generate(prompt, max_tokens=48, mode="ee", options=opts)
        assert res.tokens == plain.tokens, prompt
        st = res.stats
        assert all(18 <= l < 29 for l in st.exit_layers)
        assert st.by_source.get("exit", [0, 0]) == [st.n_drafted, st.n_accept]
        n_exit += sum(st.exit_layers.values())
        n_checked, n_confirmed = n_checked + st.n_drafted, n_confirmed + st.n_accept
    # exits came, some confirmed, some undone (an end-of-text exit is not an output token)
    assert n_confirmed >= n_exit > 0 and n_checked > n_confirmed
    assert {"draft", "layers", "probe", "head", "check"} <= set(res.stats.timings)
    # the cache stays consistent after exits: plain runs on this context afterwards equal
    # those of a fresh context (same prompt: the prefix is reused; another: it is cut)
    after = [small_llm.generate(p, max_tokens=16).tokens for p in (PROMPTS[0], PROMPTS[2])]
    with LLM(small_llm.model.path, config=LoadConfig(n_ctx=1024, n_threads=2)) as fresh:
        assert after == [fresh.generate(p, max_tokens=16).tokens for p in (PROMPTS[0], PROMPTS[2])]


def test_a_prediction_drafts_between_checked_exits(bundle, small_llm, monkeypatch):
    """ee takes a caller's prediction: where the output follows it, its drafts are verified
    at full depth in one batch; elsewhere the steps probe and exit as before, each exit
    checked. The output is plain's either way, whether ee probes or (no layer paying here)
    decodes plainly; the usage counts are OpenAI's."""
    from specee_cpp.early_exit import mode as ee_mode

    out, _ = bundle
    probing = EEOptions(provider="ngram", predictors=str(out), threshold=0.05, always=True)
    exits = 0
    for prompt in PROMPTS[:3]:
        plain = small_llm.generate(prompt, max_tokens=48)
        t = plain.tokens
        edited = t[:10] + [t[10] + 1] + t[11:24]   # a token changed, the second half missing
        for pred, opts in ((t, probing), (edited, probing),
                           (edited, EEOptions(predictors=str(out), threshold=0.05))):
            monkeypatch.setattr(ee_mode, "exit_costs", lambda llm, pred: _costs(probe=0.2))
            res = small_llm.generate(prompt, max_tokens=48, mode="ee", options=opts,
                                     prediction=pred)
            assert res.tokens == t, (prompt, opts)
            drafted, accepted = res.stats.by_source.get("prediction", (0, 0))
            if pred is t:
                assert accepted >= 36 and drafted == accepted and res.stats.prediction == (48, 0)
                assert not res.stats.exit_layers   # nothing left between the drafts to exit
            else:
                assert accepted >= 12 and sum(res.stats.prediction) == len(edited)
            if opts is probing and pred is not t:
                exits += sum(res.stats.exit_layers.values())
                assert "drafts from the prediction" in res.stats.note
    assert exits > 0   # past the prediction's end the steps probe and exit again
    for n in (1, 2, 3):   # no draft runs past the tokens asked for
        res = small_llm.generate(prompt, max_tokens=n, mode="ee", options=probing,
                                 prediction=plain.tokens)
        assert res.tokens == plain.tokens[:n] and res.stats.n_drafted <= max(n - 1, 0)


def test_bundle_for_another_model_is_refused(bundle, tiny_llama):
    out, _ = bundle
    with LLM(tiny_llama, config=LoadConfig(n_ctx=128, n_threads=1)) as llm:
        with pytest.raises(SpeceeError, match="fitted on SmolLM2"):
            llm.generate("hi", max_tokens=2, chat=False, mode="ee",
                         options=EEOptions(provider="ngram", predictors=str(out)))


def test_ee_errors(small_llm, bundle):
    out, _ = bundle
    from specee_cpp.config import SamplingConfig

    with pytest.raises(SpeceeError, match="greedily"):
        small_llm.generate("hi", max_tokens=2, mode="ee", sampling=SamplingConfig(temperature=1),
                           options=EEOptions(provider="ngram", predictors=str(out)))
    with pytest.raises(SpeceeError, match="needs a draft"):
        small_llm.generate("hi", max_tokens=2, mode="ee",
                           options=EEOptions(provider="draft", predictors=str(out)))
    with pytest.raises(SpeceeError, match="unknown candidate provider"):
        EEOptions(provider="magic")


def _costs(probe: float, draft: float = 0.5):
    """ExitCosts in plain tokens of 1 s: a 29-layer model's exits read off its layers."""
    from specee_cpp.early_exit.costs import ExitCosts

    return ExitCosts(plain_s=1.0, staged_s=1.0, probe_s=probe, head_s=0.0, exit_lo_s=18 / 29,
                     exit_hi_s=28 / 29, lo=18, hi=28, draft_s=draft, n_layer=29,
                     check_s=1.0)


def test_exits_that_cannot_pay_here_step_aside_for_plain_decoding(bundle, small_llm,
                                                                 monkeypatch):
    """Priced with this machine's costs: where a probe costs more than the layers an exit
    saves, ee decodes plainly (and says why); where probes are cheap and exits save, it
    probes and exits. Without a draft the n-gram candidates are priced alone."""
    from specee_cpp.early_exit import mode as ee_mode

    out, _ = bundle
    opts = EEOptions(predictors=str(out), threshold=0.05)
    plain = small_llm.generate(PROMPTS[0], max_tokens=48)
    monkeypatch.setattr(ee_mode, "exit_costs", lambda llm, pred: _costs(probe=0.2))
    dear = small_llm.generate(PROMPTS[0], max_tokens=48, mode="ee", options=opts)
    assert dear.tokens == plain.tokens and dear.stats.exit_layers == {}
    assert dear.stats.note.startswith("plain decoding: early exit predicted at 0.")
    assert "with ngram candidates" in dear.stats.note and "draft" not in dear.stats.note
    monkeypatch.setattr(ee_mode, "exit_costs", lambda llm, pred: _costs(probe=0.001))
    cheap = small_llm.generate(PROMPTS[0], max_tokens=48, mode="ee", options=opts)
    assert sum(cheap.stats.exit_layers.values()) > 0, cheap.stats.note


def test_an_answer_whose_exits_stop_paying_goes_on_plainly(bundle, small_llm, monkeypatch):
    """The plan learns each layer's exit rate from its probes: exits that never fire
    (threshold 1) take every layer out after a few tokens, and the rest of the answer runs
    plain decodes, equal to plain decoding."""
    from specee_cpp.early_exit import costs, mode as ee_mode

    out, _ = bundle
    monkeypatch.setattr(ee_mode, "exit_costs", lambda llm, pred: _costs(probe=0.02))
    # as the calibration's rates would have it: every layer exits a quarter of its tokens
    monkeypatch.setattr(ee_mode, "exit_plan", lambda pred, o, *refuse: (
        {l: 1.0 for l in pred.layers}, {l: 0.25 for l in pred.layers}, pred.layers, "t1"))
    real = costs.LearnedPlan.__init__

    def quick(self, *a, **k):   # learns within a few tokens
        real(self, *a, **{**k, "prior": 2, "every": 4})
    monkeypatch.setattr(costs.LearnedPlan, "__init__", quick)
    plain = small_llm.generate(PROMPTS[2], max_tokens=32)
    res = small_llm.generate(PROMPTS[2], max_tokens=32, mode="ee",
                             options=EEOptions(predictors=str(out)))
    assert res.tokens == plain.tokens and res.stats.exit_layers == {}
    assert "probe" in res.stats.timings and "decode" in res.stats.timings


def test_staged_overhead_script_reports_each_segment_count(small_model):
    """scripts/staged_overhead.py: llama_decode against staged decodes of 1-14 segments,
    one run, a ratio per line."""
    import re
    import subprocess
    import sys

    from scripts_path import SCRIPTS

    out = subprocess.run([sys.executable, str(SCRIPTS / "staged_overhead.py"), "--model",
                          str(small_model), "--repeats", "2", "--threads", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ratios = dict(re.findall(r"^\s+(.+?)\s+[\d.]+ ms\s+([\d.]+)x$", out.stdout, re.M))
    assert list(ratios) == ["llama_decode"] + [f"staged, {n} segment{'s' * (n > 1)}"
                                               for n in (1, 2, 4, 8, 14)], out.stdout
    assert float(ratios["llama_decode"]) == 1.0
    assert all(float(r) > 0 for r in ratios.values())   # the figures: BENCHMARKS.md


def test_candidates_are_asked_for_only_at_tokens_that_will_be_probed(bundle, small_llm):
    """A token with no layer to probe is a plain decode: the provider (a draft decode per
    call) is not asked, and catches up on the tokens in between when next asked."""
    from specee_cpp.early_exit.decode import generate_ee

    out, _ = bundle
    pred = Predictors.load(out)

    class EveryThird:           # SpecEE's scheduler, probing at every third token only
        n = 0

        def layers(self):
            self.n += 1
            return [pred.layers[0]] if self.n % 3 == 0 else []

        def record(self, exit_layer):
            pass

    class Counting:
        k, name = 4, "counting"

        def reset(self, prompt):
            self.asked, self.accepted = [], 0

        def accept(self, token):
            self.accepted += 1

        def propose(self):
            self.asked.append(self.accepted)
            return np.array([1, 2, 3, 4], dtype=np.int32)

    prompt = small_llm.prompt_tokens(PROMPTS[1])
    plain = small_llm.generate(PROMPTS[1], max_tokens=24).tokens
    provider = Counting()
    steps = generate_ee(small_llm.tgt.seq, prompt, provider, pred, EveryThird(),
                        {l: 1.0 for l in pred.layers})
    tokens = [next(steps).token for _ in range(24)]
    steps.close()
    assert tokens == plain
    assert provider.asked == [3 * i for i in range(1, 8)]

"""Pure numpy pieces of early exit: features, predictor training, scheduler, providers."""
import numpy as np
import pytest

from specee_cpp.bench.prompts import load_spec_bench, spread
from specee_cpp.early_exit.calibrate import masked
from specee_cpp.early_exit.candidates import NgramCandidates, top_k
from specee_cpp.early_exit.features import PAD_GAP, features, pad_logits
from specee_cpp.early_exit.predictor import Predictors, stack
from specee_cpp.mlp import train_mlp
from specee_cpp.early_exit.scheduler import Scheduler
from specee_cpp.errors import SpeceeError


def test_features_match_hand_computation():
    lg = np.array([2.0, 1.0, 0.0, -1.0])
    x, sm = features(lg, None, 4)
    e = np.exp(lg - 2.0)
    want_sm = e / e.sum()
    np.testing.assert_allclose(x[:4], lg)
    np.testing.assert_allclose(x[4:8], want_sm)
    np.testing.assert_allclose(x[8:], want_sm - 0.25)
    x2, _ = features(lg + np.array([0, 1, 0, 0]), sm, 4)
    np.testing.assert_allclose(x2[8:], x2[4:8] - want_sm)


def test_padding_of_short_candidate_lists():
    p = pad_logits(np.array([1.0, 3.0]), 4)
    assert p.tolist() == [1.0, 3.0, 1.0 - PAD_GAP, 1.0 - PAD_GAP]
    # calibration pads stored probes the same way decoding pads live ones
    probes = np.array([[[1.0, 3.0, 9.0, 9.0], [1.0, 2.0, 3.0, 4.0]]])
    out = masked(probes, np.array([2, 4]))
    np.testing.assert_allclose(out[0, 0], pad_logits(np.array([1.0, 3.0]), 4))
    np.testing.assert_allclose(out[0, 1], probes[0, 1])


def test_training_recovers_a_separable_rule():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4000, 12))
    y = (X[:, 0] - X[:, 5] > 0.3).astype(float)
    fit = train_mlp(X[:3000], y[:3000], hidden=32, epochs=100)
    pred = stack([7], [fit], k=4, threshold=0.5, meta={})
    acc = ((pred.prob(7, X[3000:]) > 0.5) == (y[3000:] > 0)).mean()
    assert acc > 0.95


def test_bundle_roundtrip_and_refusal(tmp_path):
    rng = np.random.default_rng(1)
    fit = train_mlp(rng.standard_normal((64, 12)), rng.integers(0, 2, 64), hidden=8, epochs=1)
    pred = stack([5, 6], [fit, fit], k=4, threshold=0.7,
                 meta={"target_sha256": "ab" * 32, "n_layer": 8, "target_name": "m.gguf"})
    path = tmp_path / "b.npz"
    pred.save(path)
    back = Predictors.load(path)
    assert back.layers == [5, 6] and back.threshold == 0.7 and back.k == 4
    x = rng.standard_normal(12)
    np.testing.assert_allclose(back.prob(6, x), pred.prob(6, x), rtol=1e-5)
    back.check_target("ab" * 32, 8)
    with pytest.raises(SpeceeError, match="fitted on m.gguf"):
        back.check_target("cd" * 32, 8, "other.gguf")
    (tmp_path / "junk.npz").write_bytes(b"nope")
    with pytest.raises(SpeceeError, match="not a predictor bundle"):
        Predictors.load(tmp_path / "junk.npz")


def test_scheduler_rules():
    s = Scheduler(n_layer=28, offline=[15, 21, 27, 30])
    assert s.layers() == [15, 21]                      # never the last layer or beyond
    s.record(24)
    s.record(None)                                     # no exit: nothing to remember
    assert s.layers() == [15, 21, 22, 24, 26]
    for e in (10, 11, 12, 13, 14):
        s.record(e)
    assert 24 not in s.layers() and 8 in s.layers()    # only the last 5 exits count
    s2 = Scheduler(n_layer=28, offline=[15, 21], allowed={21})
    assert s2.layers() == [21]
    # cost check: probing 15 saves 0.01 * 13 layers * 1 ms < 0.5 ms probe cost
    s3 = Scheduler(n_layer=28, offline=[15, 21], exit_rate={15: 0.01, 21: 0.3},
                   layer_cost=1e-3, probe_cost=5e-4)
    assert s3.layers() == [21]
    # a batch of rows that exits only together: 0.3 ** 2 * 7 layers * 1 ms > 0.5 ms probe,
    # 0.3 ** 4 * 7 ms < 0.5 ms
    assert s3.layers(n_rows=2) == [21] and s3.layers(n_rows=4) == []


def test_ngram_candidates():
    p = NgramCandidates(k=3, n_max=2)
    p.reset([1, 2, 3, 1, 2, 4, 1, 2])
    # after "1 2": seen followed by 4 (most recent) then 3
    assert p.propose().tolist() == [4, 3]
    p.accept(5)
    assert p.propose().tolist() == []
    p.accept(1)
    assert p.propose().tolist() == [2]
    assert top_k(np.array([0.1, 5.0, 3.0, 4.0]), 2).tolist() == [1, 3]


def test_spread_and_records(tmp_path):
    assert spread(10, 3) == [0, 3, 6] and spread(4, 0) == spread(4, 9) == [0, 1, 2, 3]
    f = tmp_path / "p.jsonl"
    f.write_text('{"category": "qa", "turns": ["a?"]}\n\n{"turns": ["b"]}\n')
    assert [(p.source_category, p.text) for p in load_spec_bench(f)] == [("qa", "a?"), ("?", "b")]


def test_prompt_file_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["hi"]}\n{"turns": []}\n')
    with pytest.raises(SpeceeError, match="p.jsonl:2"):
        load_spec_bench(f)
    with pytest.raises(SpeceeError, match="not found"):
        load_spec_bench(tmp_path / "none.jsonl")


# ---- the quality target ---------------------------------------------------------------------

def test_plans_raise_the_erring_layer_until_the_bound_meets_the_target():
    from specee_cpp.config import THRESHOLD_GRID
    from specee_cpp.early_exit.quality import choose_plans, upper_bound

    n = 400
    wrong = np.arange(n) < 20                     # at layer 20, 20 tokens' argmax is 5, not 7
    rec = {"n_cand": np.full(n, 2), "cand": np.tile([5, 7], (n, 1)),
           "logits": np.zeros((2, n, 2)), "final": np.full(n, 7),
           "argmax": np.stack([np.where(wrong, 5, 7), np.full(n, 7)])}
    # layer 20 is less sure of its wrong tokens (0.85) than of its right ones (0.95); layer
    # 21 is sure of everything (0.97)
    pred = _ScriptedPredictors({20: np.where(wrong, 0.85, 0.95), 21: 0.97})
    plans = choose_plans(pred, [rec], [20, 21], "argmax", (0.005, 0.01, 0.1))
    assert list(plans) == ["0.005", "0.01", "0.1"]
    # loosest target: everything exits at 20, 20 of 400 wrong (5%, bound under 10%)
    assert plans["0.1"]["thresholds"] == {"20": 0.5, "21": 0.5}
    assert (plans["0.1"]["exits"], plans["0.1"]["wrong"]) == (400, 20)
    # 1%: layer 20 raised past 0.85, its uncertain tokens exit right at 21: none wrong
    # of 400 (bound 0.75%)
    p = plans["0.01"]
    assert p["thresholds"] == {"20": THRESHOLD_GRID[4], "21": 0.5}
    assert (p["exits"], p["wrong"]) == (400, 0) and p["rates"] == {"20": 0.95, "21": 0.05}
    # 0.5% needs more than 400 clean exits: no plan at all
    assert upper_bound(0, 400) > 0.005 and plans["0.005"]["thresholds"] == {}


def test_error_bounds_are_clopper_pearson():
    from specee_cpp.early_exit.quality import _binom_cdf, interval, lower_bound, upper_bound

    # no exit wrong: the bound solves (1 - p)^n = 5%, 1% needs 299 exits
    assert upper_bound(0, 299) <= 0.01 < upper_bound(0, 298)
    assert upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50), rel=1e-6)
    # with some wrong, the bound is where seeing that few becomes a 5% event
    for wrong, n in ((3, 1000), (12, 400)):
        assert _binom_cdf(wrong, n, upper_bound(wrong, n)) == pytest.approx(0.05, rel=1e-4)
        low = lower_bound(wrong, n)
        assert 1 - _binom_cdf(wrong - 1, n, low) == pytest.approx(0.05, rel=1e-4)
        lo, hi = interval(wrong, n)
        assert lo < low < wrong / n < upper_bound(wrong, n) < hi
    assert lower_bound(0, 100) == 0.0 and upper_bound(0, 0) == 1.0 and upper_bound(5, 5) == 1.0


class _ScriptedPredictors:
    """Predictor probabilities set per layer (one for every token, or one each); records
    the features each probe saw."""
    k = 2

    def __init__(self, prob: dict):
        self.p, self.seen = prob, []

    def prob(self, layer, x):
        self.seen.append((layer, np.array(x)))
        return np.broadcast_to(self.p[layer], x.shape[:-1])


def test_simulated_exits_probe_the_allowed_layers_in_order_and_count_wrong_tokens():
    from specee_cpp.early_exit.features import softmax
    from specee_cpp.early_exit.quality import exit_error, simulate

    layers = [10, 11, 12]
    lg = np.array([[[0.0, 1.0]], [[3.0, 0.0]], [[2.0, 0.5]]])     # (layer, token, k)
    rec = {"n_cand": np.array([2]), "cand": np.array([[5, 7]]), "logits": lg,
           "argmax": np.array([[7], [9], [7]]), "final": np.array([7])}
    pred = _ScriptedPredictors({10: 0.4, 11: 0.99, 12: 0.9})
    # layer 11 would fire but is not allowed; 10 does not fire; 12 fires with a candidate
    exits, correct = simulate(pred, rec, layers, {10: 0.5, 12: 0.5})
    assert exits.tolist() == [12] and correct.tolist() == [True]
    # the change feature at 12 is taken from the previous probe, layer 10, not 11
    (l10, x10), (l12, x12) = pred.seen
    assert (l10, l12) == (10, 12)
    np.testing.assert_allclose(x12[0, 4:], softmax(lg[2, 0]) - softmax(lg[0, 0]))
    # SpecEE's rule: a layer whose argmax is no candidate does not exit, however sure
    pred = _ScriptedPredictors({10: 0.4, 11: 0.99, 12: 0.9})
    assert simulate(pred, rec, layers, {11: 0.5})[0].tolist() == [-1]
    # the candidate rule emits the top candidate (7 at 10, 5 at 11): wrong when not final
    pred = _ScriptedPredictors({10: 0.4, 11: 0.99, 12: 0.9})
    exits, correct = simulate(pred, rec, layers, {11: 0.5, 12: 0.5}, rule="candidate")
    assert exits.tolist() == [11] and correct.tolist() == [False]
    # a token with no candidates is never probed
    empty = dict(rec, n_cand=np.array([0]))
    assert simulate(pred, empty, layers, {10: 0.0})[0].tolist() == [-1]
    m = exit_error(_ScriptedPredictors({10: 0.4, 11: 0.99, 12: 0.9}), [rec, rec, empty], layers,
                   {11: 0.5, 12: 0.5}, rule="candidate")
    assert (m["tokens"], m["exits"], m["wrong"], m["error"]) == (3, 2, 2, 1.0)
    assert m["mean_exit_layer"] == 11 and m["low"] > 0.1 and m["high"] == 1.0


def test_the_held_out_split_spans_the_pool():
    from specee_cpp.early_exit.calibrate import split

    train, val = split(list(range(100)), 0.4)
    assert len(val) == 40 and len(train) == 60 and not set(train) & set(val)
    # a pool sorted by category: its last categories are not all the plans see
    assert min(val) < 10 and max(val) > 90
    assert split([0, 1], 0.4) == ([1], [0])


def test_exit_plan_takes_the_plan_of_the_target_and_an_explicit_threshold():
    from specee_cpp.early_exit.mode import EEOptions, exit_plan

    fit = (np.zeros(12), np.ones(12), np.zeros((12, 2)), np.zeros(2), np.zeros(2), 0.0)
    plan = {"thresholds": {"5": 0.9}, "rates": {"5": 0.4}, "exits": 400, "wrong": 1,
            "tokens": 1000}
    none = {"thresholds": {}, "rates": {}, "exits": 0, "wrong": 0, "tokens": 1000}
    plans = {"argmax": {"0.005": none, "0.01": plan, "0.05": dict(plan, thresholds={
                 "5": 0.5, "6": 0.7}, rates={"5": 0.5, "6": 0.2})},
             "candidate": {"0.01": none}}
    pred = stack([5, 6], [fit, fit], k=4, threshold=0.5, meta={"exit_plans": plans})
    th, rates, offline, note = exit_plan(pred, EEOptions(provider="ngram"))
    assert th == {5: 0.9} and rates == {5: 0.4} and offline == [5]
    assert "exits at 1 of 2 layers" in note and "1 of 400 exits differed" in note
    # another target takes the loosest calibrated one not above it
    assert exit_plan(pred, EEOptions(provider="ngram", max_exit_error=0.03))[0] == {5: 0.9}
    assert exit_plan(pred, EEOptions(provider="ngram", max_exit_error=0.2))[0] == {5: 0.5, 6: 0.7}
    for o in (EEOptions(provider="ngram", max_exit_error=0.004),
              EEOptions(provider="ngram", max_exit_error=0.005),
              EEOptions(provider="ngram", rule="candidate")):
        th, _, _, note = exit_plan(pred, o)
        assert th == {} and "every token at full depth" in note
    th, _, _, note = exit_plan(pred, EEOptions(provider="ngram", threshold=0.9))
    assert th == {5: 0.9, 6: 0.9} and "every layer" in note
    # where exits reach the output (spec-ee), those whose error is not measured against the
    # target run only when asked for; ee checks each exit, so it refuses none
    from specee_cpp.spec_ee.mode import SpecEEOptions
    with pytest.raises(SpeceeError, match="--threshold 0.9 exits without the quality target"):
        SpecEEOptions(threshold=0.9)
    assert SpecEEOptions(threshold=0.9, unsafe=True).ee.threshold == 0.9
    assert SpecEEOptions(threshold=1.0).threshold == 1.0     # never fires: nothing to risk
    bare = stack([5, 6], [fit, fit], k=4, threshold=0.5, meta={})
    with pytest.raises(SpeceeError, match="no exit plans.*fit it again"):
        exit_plan(bare, EEOptions(provider="ngram"), refuse_unmeasured=True)
    assert exit_plan(bare, EEOptions(provider="ngram"))[0] == {5: 0.5, 6: 0.5}
    # measured on prompts the calibration did not see (scripts/exit_error.py): refused at a
    # target below the whole interval, allowed where the interval reaches it
    pred.meta["end_to_end"] = {"argmax": {
        "0.01": {"error": 0.045, "low": 0.03, "high": 0.06, "exits": 610, "prompts": "P"},
        "0.05": {"error": 0.055, "low": 0.045, "high": 0.066, "exits": 900, "prompts": "P"}}}
    with pytest.raises(SpeceeError, match=r"measured at 4.5% wrong \(3.0%-6.0%, 610 exits on P"
                                          r".*--unsafe-exits"):
        exit_plan(pred, EEOptions(provider="ngram"), refuse_unmeasured=True)
    assert exit_plan(pred, EEOptions(provider="ngram"))[0] == {5: 0.9}
    assert exit_plan(pred, EEOptions(provider="ngram", max_exit_error=0.05), True)[0]
    # a target between the calibrated ones takes the stricter plan, and its measured error
    with pytest.raises(SpeceeError, match="measured at 4.5% wrong"):
        exit_plan(pred, EEOptions(provider="ngram", max_exit_error=0.029), True)
    assert exit_plan(pred, EEOptions(provider="ngram", max_exit_error=0.031), True)[0] == {5: 0.9}
    with pytest.raises(SpeceeError, match="max_exit_error"):
        EEOptions(max_exit_error=1.5)


def test_repetition_guard_sees_loops_only():
    from specee_cpp.spec_ee.verify import looping

    assert looping([1, 2, 3] + [7, 8] * 3)
    assert looping([5] * 3)
    assert not looping([5] * 2)
    assert not looping(list(range(40)))
    assert not looping([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert looping([9] + list(range(16)) * 3)       # the longest block it looks for
    assert not looping(list(range(17)) * 2)


def test_mlp_forward_saturates_without_overflow():
    import warnings

    from specee_cpp.mlp import forward

    # one hidden unit passing x through, output weight -1 / +1: logits of -x / x
    net = (np.zeros(1), np.ones(1), np.ones((1, 1)), np.zeros(1), np.array([-1.0]), np.zeros(1))
    X = np.array([[0.0], [2.0], [800.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = forward(net, X)
    assert p == pytest.approx([0.5, 1 / (1 + np.exp(2.0)), 0.0])
    net = net[:4] + (np.array([1.0]), np.zeros(1))
    assert forward(net, X) == pytest.approx([0.5, 1 / (1 + np.exp(-2.0)), 1.0])


def _exit_costs(probe: float, head: float = 0.0):
    """ExitCosts in plain tokens of 1 s for a 28-layer model whose staged token costs what a
    plain one does: a token exiting at layer l costs l / 28."""
    from specee_cpp.early_exit.costs import ExitCosts

    return ExitCosts(plain_s=1.0, staged_s=1.0, probe_s=probe, head_s=head, exit_lo_s=14 / 28,
                     exit_hi_s=26 / 28, lo=14, hi=26, draft_s=0.5, n_layer=28,
                     check_s=1.0)


def test_an_exit_plan_keeps_only_layers_whose_savings_beat_their_probes():
    from specee_cpp.early_exit.costs import LearnedPlan

    c = _exit_costs(probe=0.01)
    rates = {20: 0.3, 24: 0.2, 26: 0.001}
    # a layer that almost never exits costs its probe for nothing: left out
    layers, t = c.best_layers(list(rates), rates, "candidate", 0.0)
    assert layers == [20, 24] and t < 1.0
    assert t == pytest.approx(c.token_s([20, 24], rates, "candidate", 0.0))
    # expected time by hand: probe 20; 0.3 exit there; 0.7 probe 24; 0.14 exit; rest to the end
    want = 0.01 + 0.3 * 20 / 28 + 0.7 * 0.01 + 0.7 * 0.2 * 24 / 28 + 0.56 * 1.0
    assert c.token_s([20, 24], rates, "candidate", 0.0) == pytest.approx(want)
    # a draft token per token (half a plain one) outweighs what these exits save: the best
    # layers to probe still lose to plain decoding, and a plan probes none
    layers, t = c.best_layers(list(rates), rates, "candidate", 0.5)
    assert t > 1.0
    plan = LearnedPlan(c, rates, "candidate", 0.5)
    assert plan.chosen == [] and plan.speed() == 1.0 and plan.probing_speed() == 1.0 / t
    # SpecEE's head on every exit, a fifth of a token: dearer than the candidate rule
    h = _exit_costs(probe=0.01, head=0.2)
    assert h.token_s([20], rates, "argmax", 0.0) == pytest.approx(
        h.token_s([20], rates, "candidate", 0.0) + 0.3 * 0.2)


def test_a_learned_plan_drops_layers_whose_exits_do_not_come():
    from specee_cpp.early_exit.costs import LearnedPlan

    plan = LearnedPlan(_exit_costs(probe=0.01), {20: 0.3, 24: 0.2}, "candidate", 0.0,
                       prior=8, every=4)
    assert plan.chosen == [20, 24] and plan.speed() > 1.0
    for _ in range(8):   # probed at both, never exiting
        plan.record([20, 24], None)
    assert plan.rates()[20] == pytest.approx(0.3 * 8 / 16)
    for _ in range(80):   # a rate near 0.03 no longer pays a probe of 0.01 at layer 20
        plan.record(plan.chosen, None)
    assert plan.chosen == [] and plan.speed() == 1.0
    # exits that come as the calibration said keep the plan
    kept = LearnedPlan(_exit_costs(probe=0.01), {20: 0.3}, "candidate", 0.0, prior=8, every=4)
    for i in range(40):
        kept.record([20], 20 if i % 3 == 0 else None)
    assert kept.chosen == [20]


def test_calls_timed_in_turn_undo_each_call_and_skip_the_warm_up():
    """engine.timing.time_calls (early exit's prices, scripts/staged_overhead.py): each
    call's median over the counted rounds, its undo run after every call and not timed."""
    from specee_cpp.engine.timing import time_calls

    now = [0.0]
    undone: list[str] = []
    cost = {"a": [5.0, 1.0, 2.0, 3.0], "b": [9.0, 4.0, 4.0, 6.0]}   # first round: warm-up

    def call(name):
        def run():
            now[0] += cost[name].pop(0)
        return run, lambda: (undone.append(name), now.__setitem__(0, now[0] + 100.0))

    med = time_calls({n: call(n) for n in cost}, rounds=3, warmup=1, clock=lambda: now[0])
    assert med == {"a": 2.0, "b": 4.0} and undone == ["a", "b"] * 4

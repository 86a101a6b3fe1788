"""Draft-length control: the policies' rules, the acceptance models' fit, the replay, and
greedy losslessness of every policy on a real model."""
from __future__ import annotations

import numpy as np
import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.speculative import acceptance, policies, simulate
from specee_cpp.speculative.cost import CostModel
from specee_cpp.speculative.policies import Outcome, RoundAt
from specee_cpp.errors import SpeceeError

# the shape measured on this CPU (specee-cpp costs): draft 0.59 of a target token, verify
# 2/4/8/16 tokens = 1.68/2.77/6.44/8.34 target tokens
CPU = CostModel([0.034 * x for x in (1.0, 1.68, 2.27, 2.77, 3.5, 4.15, 4.64, 6.44, 7.05, 7.4,
                                      8.09, 8.3, 8.39, 9.2, 9.6, 8.34)], 0.593 * 0.034)
GPU = simulate.gpu_like(CPU, bpw=4.85)
# the 2-core AVX2 EPYC's with its AVX2 Q4_K rows kernel (`specee-cpp costs`, 128 tokens of
# context): verify 2/4/8/16 = 1.30/1.91/3.80/6.06 plain tokens, a draft token (IQ4_NL) 0.43,
# a round's first 0.66: drafting pays from 90% acceptance
EPYC_S38 = CostModel([0.0438 * x for x in (0.994, 1.302, 1.641, 1.914, 2.432, 2.766, 2.972,
                                           3.796, 3.787, 3.785, 4.662, 4.335, 5.502, 5.428,
                                           5.686, 6.055)],
                     0.431 * 0.0438, plain_token_s=0.0438, draft_first_s=0.663 * 0.0438)
# the AMX Xeon's: verify 2/4/8/16 = 1.61/1.77/2.02/2.70, a draft token 0.43
XEON = CostModel([0.084 * x for x in (1.0, 1.61, 1.69, 1.77, 1.83, 1.89, 1.95, 2.02, 2.1,
                                      2.18, 2.26, 2.34, 2.42, 2.5, 2.6, 2.70)], 0.43 * 0.084)


def synthetic_records(n_runs: int = 40, gamma: int = 8, bpw: float = 4.85, seed: int = 0,
                      easy: float = 0.0) -> list[dict]:
    """Profile-like rounds: a drafted token is accepted with probability top1 (+ easy)."""
    rng = np.random.default_rng(seed)
    recs = []
    for run in range(n_runs):
        for _ in range(12):
            top1 = rng.uniform(0.1, 1.0, gamma)
            ent = (1 - top1) * 3
            acc = 0
            while acc < gamma and rng.random() < min(top1[acc] + easy, 1.0):
                acc += 1
            recs.append({"prompt_id": run, "gamma": gamma, "draft_top1": top1.tolist(),
                         "draft_entropy": ent.tolist(), "n_accept": acc,
                         "target_quant": "Q4_K_M", "target_bpw": bpw})
    return recs


@pytest.fixture(scope="module")
def model():
    return acceptance.fit(synthetic_records(), epochs=60)


def test_baseline_rules():
    assert policies.FixedGamma(3).plan() == 3 and policies.FixedGamma(0).plan_is_plain
    pm = policies.PMinRule()
    assert pm.plan() == 8 and pm.keep(0, 0.8, 0.5) and not pm.keep(0, 0.7, 0.5)
    hf = policies.HFHeuristic(start=4)
    hf.update(Outcome(4, 4, [], []))
    assert hf.plan() == 6
    hf.update(Outcome(6, 2, [], []))
    assert hf.plan() == 5
    for _ in range(10):
        hf.update(Outcome(1, 0, [], []))
    assert hf.plan() == 1


def test_acceptance_models_learn_confidence(model, tmp_path):
    # the per-token model ranks a confident draft token above an unsure one
    assert model.token_p(0.95, 0.15, 0, 4.85) > model.token_p(0.2, 2.4, 0, 4.85) + 0.3
    # the round rate falls with gamma (each token must survive all before it)
    r = model.rates(model.prior[:5] + [4.85], np.arange(1, 9))
    assert r[0] > r[-1]
    model.save(tmp_path / "c.npz")
    back = acceptance.AcceptanceModel.load(tmp_path / "c.npz")
    np.testing.assert_allclose(back.rates(model.prior[:5] + [4.85], [1, 4]),
                               model.rates(model.prior[:5] + [4.85], [1, 4]), rtol=1e-5)
    with pytest.raises(SpeceeError, match="not found"):
        acceptance.AcceptanceModel.load(tmp_path / "missing.npz")
    with pytest.raises(SpeceeError, match="target_bpw"):
        acceptance.fit([{k: v for k, v in r.items() if k != "target_bpw"}
                        for r in synthetic_records(2)])


def test_labels_of_shorter_gammas_come_from_longer_rounds():
    recs = [{"prompt_id": 0, "gamma": 4, "draft_top1": [0.9] * 4, "draft_entropy": [0.1] * 4,
             "n_accept": a, "target_bpw": 4.0} for a in (4, 2)]
    X, y = acceptance.round_dataset(recs)
    assert X[:, -1].tolist() == [1, 2, 3, 4]            # candidate gammas of round 2
    assert y.tolist() == [1.0, 1.0, 2 / 3, 0.5]          # min(2, g) / g
    assert X[0, 4] == 1.0                                # round 1's acceptance rate
    Xt, yt = acceptance.token_dataset(recs)
    assert yt.tolist() == [1, 1, 1, 1, 1, 1, 0]          # 4 accepted; 2 accepted + 1 rejected


def test_cost_aware_policies_follow_the_costs(model):
    cpu = policies.CostAwareGamma(model, CPU, 4.85)
    assert cpu.plan_is_plain and cpu.plan() == 0           # nothing can pay on this CPU
    assert policies.CostAwareStop(model, CPU, 4.85).plan_is_plain
    gpu = policies.CostAwareGamma(model, GPU, 4.85)
    assert not gpu.plan_is_plain and gpu.plan() >= 2       # drafting is cheap there
    stop = policies.CostAwareStop(model, GPU, 4.85)
    assert stop.plan() == 8
    assert stop.keep(0, 0.99, 0.05) and stop.more(0)
    assert not stop.keep(1, 0.02, 6.0)                     # a hopeless token is dropped
    with pytest.raises(SpeceeError, match="unknown draft-length policy"):
        policies.make_policy("often")
    with pytest.raises(SpeceeError, match="needs a fitted controller"):
        policies.make_policy("auto")


class LastRate:
    """An acceptance model that predicts the last round's acceptance rate for every gamma
    and a token's top-1 probability for the token: the policy's logic without a fit."""
    prior = [0.5, 1.0, 0.8, 0.6, 0.8]

    def rates(self, feats, gammas):
        return np.full(len(gammas), feats[4])

    def token_p(self, top1, entropy, pos, bpw):
        return top1


def test_auto_cuts_each_round_where_its_tokens_stop_paying(model):
    """auto's round model decides whether to draft and at most how many; the token rule
    then drops an unsure token (the round model alone drafted its whole gamma: 48% accepted
    on HumanEval on the AMX Xeon, 0.948x plain). An exploring single-token round keeps its
    token whatever it promises: only a drafted token refreshes the round statistics."""
    gpu = policies.CostAwareGamma(model, GPU, 4.85)
    g = gpu.plan()
    assert g >= 2
    assert gpu.keep(0, 0.99, 0.05) and gpu.more(0)
    assert not gpu.keep(1, 0.02, 6.0)
    # the AMX Xeon's shape (verify nearly flat, a draft token 0.43): drafting pays only at
    # high acceptance, so a hopeless last round means plain steps, then one explorer
    xeon = policies.CostAwareGamma(LastRate(), XEON, 4.85)
    xeon.feats = [0.05, 0.1, 0.99, 0.97, 0.95, 4.85]
    assert xeon.plan() >= 4
    xeon.feats = [5.0, 6.0, 0.05, 0.01, 0.0, 4.85]
    plans = [xeon.plan() for _ in range(xeon.explore_every)]
    assert plans[:-1] == [0] * (xeon.explore_every - 1) and plans[-1] == 8
    assert xeon.keep(0, 0.02, 6.0)                  # the explorer keeps its first token
    assert not xeon.more(0)                         # and stops there: it was hopeless
    xeon.feats = [5.0, 6.0, 0.05, 0.01, 0.0, 4.85]
    for _ in range(xeon.explore_every - 1):
        xeon.plan()
    assert xeon.plan() == 8
    assert xeon.keep(0, 0.99, 0.01) and xeon.more(0)   # a sure draft: drafts on
    assert xeon.keep(1, 0.99, 0.01)
    assert not xeon.keep(2, 0.02, 6.0)              # past the first token, the rule holds


def test_the_token_rule_pays_in_replay(model):
    """Replayed on rounds whose tokens are accepted as often as the draft is sure of them,
    auto with the token rule beats the same round model drafting its whole gamma, in
    acceptance and in speed."""
    class RoundOnly(policies.CostAwareGamma):
        def keep(self, i, top1, entropy):
            return True

        def more(self, i):
            return True

    recs = synthetic_records(n_runs=10, seed=5)
    auto = simulate.replay(recs, lambda: policies.CostAwareGamma(model, GPU, 4.85), GPU)
    whole = simulate.replay(recs, lambda: RoundOnly(model, GPU, 4.85), GPU)
    assert whole.drafted > 0 and auto.drafted > 0
    assert auto.accepted / auto.drafted > whole.accepted / whole.drafted + 0.05
    assert auto.speedup > whole.speedup


def test_a_round_whose_drafts_were_all_dropped_counts_as_drafted():
    """The per-token rule may drop a round's first token after paying for it: the guard
    must see that round as a drafted one (slow), not as a plain step (which would make
    plain look slower and drafting better than they are)."""
    stop = policies.CostAwareStop(LastRate(), XEON, 4.85)
    plain_s = XEON.plain
    for _ in range(8):
        stop.update(Outcome(0, 0, [], [], plain_s))     # real plain steps
    for _ in range(stop.guard.window):
        assert stop.plan() > 0
        assert not stop.keep(0, 0.02, 6.0)
        stop.update(Outcome(0, 0, [], [], plain_s + XEON.draft(1), tried=True))
    assert stop.plan() == 0                             # backed off: the tries lost
    assert stop.guard.plain_tps() == pytest.approx(1 / plain_s)


def test_predicted_speed_of_model_drafting_weighs_free_drafts(model):
    """The policy's predicted round (tokens/s) is what a free draft from the context must
    beat: none where model drafting cannot pay, the best gamma's speed where it can, none
    while the guard keeps the policy at plain decoding."""
    from specee_cpp.speculative.context_drafter import ContextSource

    assert policies.CostAwareGamma(model, CPU, 4.85).predicted_tps() == 0.0
    assert policies.FixedGamma(4).predicted_tps() == 0.0
    gpu = policies.CostAwareGamma(model, GPU, 4.85)
    best = gpu.predicted_tps()
    assert best > 1.0 / GPU.plain
    g = gpu.plan()
    assert best == pytest.approx((1 + model.rates(gpu.feats, [g])[0] * g)
                                 / (GPU.draft(g) + GPU.verify(g + 1)))
    gpu.guard.wait = 3
    assert gpu.predicted_tps() == 0.0
    # a context draft of shares 1.0 predicts more than plain; it takes the round only if it
    # also beats the model's best (decode.generate_spec compares the two)
    src = ContextSource(GPU)
    src.extend(list(range(20, 40)) * 3 + [20, 21])
    assert src.plan(100) and src.expected_tps > 1.0 / GPU.plain


def test_replay_arithmetic():
    recs = [{"prompt_id": 0, "gamma": 4, "draft_top1": [0.9] * 4, "draft_entropy": [0.1] * 4,
             "n_accept": a, "target_bpw": 4.0} for a in (4, 1)]
    costs = CostModel([1.0, 1.5, 2.0, 2.5, 3.0], 0.5)
    r = simulate.replay(recs, lambda: policies.FixedGamma(2), costs)
    # round 1: 2 drafted, 2 accepted -> 3 tokens; round 2: 1 accepted -> 2 tokens
    assert (r.tokens, r.drafted, r.accepted) == (5, 4, 3)
    assert r.seconds == pytest.approx(2 * (2 * 0.5 + 2.0))
    assert r.speedup == pytest.approx(5 / 6)
    plain = simulate.replay(recs, lambda: policies.FixedGamma(0), costs)
    assert plain.speedup == pytest.approx(1.0)


def test_replay_ranks_policies_by_machine(model):
    recs = synthetic_records(n_runs=6, seed=3, easy=0.2)
    auto_cpu = simulate.replay(recs, lambda: policies.CostAwareGamma(model, CPU, 4.85), CPU)
    fixed_cpu = simulate.replay(recs, lambda: policies.FixedGamma(4), CPU)
    assert auto_cpu.speedup == pytest.approx(1.0) and fixed_cpu.speedup < 1.0
    auto_gpu = simulate.replay(recs, lambda: policies.CostAwareGamma(model, GPU, 4.85), GPU)
    assert auto_gpu.speedup > 1.2 and auto_gpu.mean_gamma > 1


@pytest.fixture(scope="module")
def pair(small_model, tmp_path_factory):
    """SmolLM2 Q4_1 as target, the same weights requantized to Q2_K as draft: one tokenizer,
    but a draft that is often wrong, so that verification rejects and rolls back for real
    (a target drafting for itself is accepted almost always and hides rollback bugs)."""
    from specee_cpp.engine.llm import LLM
    from specee_cpp.bindings.quantize import quantize

    draft, _ = quantize(small_model, "Q2_K", tmp_path_factory.mktemp("rough-draft"), n_threads=2)
    with LLM(small_model, draft=draft, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        yield llm


@pytest.mark.model
def test_every_policy_is_lossless(pair, model):
    make = [lambda: policies.PMinRule(), lambda: policies.HFHeuristic(),
            lambda: policies.SpecKVObjective(model, 4.85),
            lambda: policies.CostAwareGamma(model, GPU, 4.85),
            lambda: policies.CostAwareStop(model, GPU, 4.85)]
    from specee_cpp.config import SamplingConfig
    from specee_cpp.speculative.decode import generate_spec
    from specee_cpp.engine.steps import stream

    rejected: dict[str, int] = {}
    for prompt in ("Write a Python function that reverses a string.", "def fib(n):"):
        plain = pair.generate(prompt, max_tokens=32)
        toks = pair.prompt_tokens(prompt)
        for mk in make:
            pol = mk()
            pair.reset()
            steps = stream(generate_spec(pair.tgt.seq, pair.dft.seq, toks, pol, SamplingConfig()),
                           piece=pair.model.token_to_piece, is_eog=pair.model.is_eog,
                           max_tokens=32, n_prompt=len(toks))
            out = [s for s in steps]
            got = [s.token for s in out if s.finish_reason != "stop"]
            assert got == plain.tokens, (prompt, pol.name)
            st = out[-1].stats
            assert st.n_drafted > 0 and "control" in st.timings, pol.name
            rejected[pol.name] = rejected.get(pol.name, 0) + st.n_drafted - st.n_accept
    # every policy saw rejected drafts, so the equality above covered rollbacks
    assert all(n > 0 for n in rejected.values()), rejected


@pytest.mark.model
def test_the_guard_lives_with_the_pair_and_its_options(pair, model, tmp_path):
    """A guard lives from one generation to the next (a chat's next turn, a bench's next
    prompt), one for each options it judged; a wait it was in when the last one ended is
    dropped, so the next prompt is probed."""
    from specee_cpp.speculative.mode import SpecOptions, draft_policy, forget_costs, use_cost_model

    model.save(tmp_path / "ctl.npz")
    use_cost_model(pair, GPU)   # drafting pays there
    auto = SpecOptions(gamma="auto", controller=tmp_path / "ctl.npz", context=False)
    stop = SpecOptions(gamma="stop", controller=tmp_path / "ctl.npz", context=False)
    first = draft_policy(pair, auto)
    assert draft_policy(pair, auto).guard is first.guard
    assert draft_policy(pair, stop).guard is not first.guard
    assert draft_policy(pair, auto).correction is first.correction   # kept alike
    assert draft_policy(pair, stop).correction is None   # no round model to correct
    from specee_cpp.bench.configs import SpecBenchOptions

    raw = SpecBenchOptions(gamma="auto", controller=tmp_path / "ctl.npz", context=False,
                           correction=False)
    assert draft_policy(pair, raw).correction is None and draft_policy(pair, raw).plan() > 0
    free = pair.generate("def fib(n):", max_tokens=24, mode="spec", options=auto)
    assert free.stats.n_drafted > 0
    first.guard.wait, first.guard.losing = 10_000, True   # as after probes that kept losing
    pair.reset()
    probed = pair.generate("def fib(n):", max_tokens=24, mode="spec", options=auto)
    assert probed.stats.n_drafted > 0 and probed.tokens == free.tokens
    assert draft_policy(pair, auto).guard is first.guard
    assert pair.generate("def fib(n):", max_tokens=24, mode="spec",
                         options=stop).stats.n_drafted > 0
    forget_costs(pair)


def test_a_long_prompt_under_a_short_limit_is_not_read_up_front():
    """The draft reads the prompt up front only where the rounds the round model predicts
    can win the read back within the caller's limit (seen: ~290-token RAG prompts read for
    64-token answers cost ~1 s each and spec-auto ran 0.97x plain end to end on the Ice Lake
    Xeon). The first read goes ahead whatever it costs and teaches the guard its price,
    where some round is predicted to beat plain at all."""
    pol = policies.CostAwareGamma(LastRate(), XEON, 4.85)   # prior: 80% accepted
    assert pol.reads_prompt(RoundAt(288, 289, 62))          # no price seen yet
    pol.prompt_read(XEON.draft_token_s * (1 + 0.2 * 288), 288)
    assert pol.guard.catch_up_rel * XEON.plain == pytest.approx(0.2 * XEON.draft_token_s)
    assert not pol.reads_prompt(RoundAt(288, 289, 62))  # ~2.1 s of read, ~1.5 s saved
    assert pol.reads_prompt(RoundAt(100, 101, 62))
    assert pol.reads_prompt(RoundAt(288, 289, 1022))      # a chat's limit: read, as before
    assert pol.reads_prompt(RoundAt(288, 289, None))
    pol.guard.wait = 16                     # held at plain decoding: nothing to read for
    assert not pol.reads_prompt(RoundAt(100, 101, 62))
    # a table where no round the prior predicts beats plain: no first read to learn from
    # (the 2-core EPYC with AVX2 only: draft 0.52, verify 2/4/8 = 1.67/2.13/3.51)
    epyc = CostModel([0.057 * x for x in (1.0, 1.67, 1.9, 2.13, 2.48, 2.82, 3.17, 3.51)],
                     0.52 * 0.057)
    assert epyc.drafting_can_pay(7)                # with every token accepted it would
    steep = policies.CostAwareGamma(LastRate(), epyc, 4.85)
    assert not steep.reads_prompt(RoundAt(288, 289, 1022))
    assert steep.reads_prompt(RoundAt(288, 289, None))
    # the rules that ignore costs read every prompt
    assert policies.FixedGamma(4).reads_prompt(RoundAt(288, 289, 62))
    assert not policies.FixedGamma(0).reads_prompt(RoundAt(288, 289, 62))


@pytest.mark.model
def test_a_prompt_not_read_up_front_is_not_read_at_all(pair, model):
    """Through generate_spec: where the read cannot pay within the limit the draft's cache
    stays empty (the rounds after weigh the same catch-up, only longer), greedy output is
    plain's; with room for it the prompt is read in prefill, as before."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.speculative.decode import generate_spec

    prompt = "Write a Python function that reverses a string."
    toks = pair.prompt_tokens(prompt)

    def run(max_new: int, price_in_tokens: float | None):
        pol = policies.CostAwareGamma(model, GPU, 4.85)
        if price_in_tokens is not None:
            # a catch-up per-token price making the read cost what `price_in_tokens`
            # tokens of the prior's best round save
            pol.reads_prompt(RoundAt(len(toks), len(toks) + 1, max_new))
            saving = GPU.plain - 1.0 / float(pol._tps().max())
            extra = price_in_tokens * saving - GPU.draft_token_s + GPU.draft(1)
            pol.guard.catch_up_rel = extra / (GPU.plain * (len(toks) + 1))
        pair.reset()
        gen = generate_spec(pair.tgt.seq, pair.dft.seq, toks, pol, SamplingConfig(),
                            max_new=max_new)
        out = [next(gen).token]
        read = len(pair.dft.seq.tokens) == len(toks)
        out += [next(gen).token for _ in range(max_new - 1)]
        return read, out, pol

    plain = pair.generate(prompt, max_tokens=12).tokens
    read, out, _ = run(6, price_in_tokens=20.0)
    assert not read and out == plain[:6] and pair.dft.seq.tokens == []
    read, out, _ = run(12, price_in_tokens=2.0)
    assert read and out == plain
    read, _, pol = run(6, price_in_tokens=None)   # no price seen: read, and learn it
    assert read and pol.guard.catch_up_rel is not None


@pytest.mark.model
def test_a_round_is_told_the_drafts_catch_up(pair):
    """After plain steps the draft is behind by as many tokens; the first drafted round
    catches it up in one batch, timed apart (``catch_up``) and passed to the policy with
    the round's time, which includes it (the guard decides what to charge: Guard)."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.speculative.decode import generate_spec

    class Late(policies.DraftPolicy):
        """Plain for 12 steps, then 2 tokens a round; records what update() is told."""
        def __init__(self):
            self.n, self.seen, self.behinds = 0, [], []

        def choose(self):
            self.n += 1
            self.behinds.append(self.behind)
            return 2 if self.n > 12 else 0

        def update(self, o):
            self.seen.append((o.tried, o.seconds, o.catch_up))

    pair.reset()
    pol = Late()
    steps = []
    for st in generate_spec(pair.tgt.seq, pair.dft.seq, pair.prompt_tokens("def fib(n):"),
                            pol, SamplingConfig()):
        steps.append(st)
        if len(steps) >= 24:
            break
    rounds = [s for s in steps[1:] if s.timings]   # one step per round carries its timings
    first = next(i for i, (tried, _, _) in enumerate(pol.seen) if tried)
    assert first == 12
    t = rounds[first].timings
    assert t["catch_up"] > t["control"]            # the 12 plain steps, in one batch
    tried, seconds, catch_up = pol.seen[first]
    assert catch_up == t["catch_up"]
    own = t["draft"] + t["verify"] + t["catch_up"]
    assert own <= seconds <= own + t["control"]
    assert all("catch_up" not in r.timings for r in rounds[first + 1:])
    assert all(c == 0.0 for _, _, c in pol.seen[first + 1:])
    # the policy was told how far behind the draft was before each round: one token (the
    # target's pending one) after the prompt, one more per plain step, 1-2 after a round
    assert pol.behinds[:13] == list(range(1, 14))
    assert all(1 <= b <= 2 for b in pol.behinds[14:])


@pytest.mark.model
def test_gamma_auto_on_this_cpu_is_plain_decoding(pair, model, tmp_path):
    from specee_cpp.speculative.mode import SpecOptions, use_cost_model

    model.save(tmp_path / "ctl.npz")
    use_cost_model(pair, CPU)   # the shape measured on this machine: drafting cannot pay
    opts = SpecOptions(gamma="auto", controller=tmp_path / "ctl.npz", context=False)
    res = pair.generate("def fib(n):", max_tokens=24, mode="spec", options=opts)
    assert res.tokens == pair.generate("def fib(n):", max_tokens=24).tokens
    assert res.stats.n_drafted == 0
    with pytest.raises(SpeceeError, match="gamma must be a number of tokens >= 0 or one of"):
        pair.generate("x", max_tokens=2, mode="spec", gamma="sometimes")


def test_a_draft_that_pays_only_near_full_acceptance_is_left_out():
    """A cost-aware run keeps the draft model only where some acceptance of the work levels
    (0.6-0.9) is predicted to gain 5%: on that AVX2 EPYC's table the draft can pay (at 90%+,
    1.0002x at 0.9), and holding it cost spec-auto 9-14% in two first-turn categories with no
    model-drafted token kept."""
    from dataclasses import replace

    from specee_cpp.speculative.variants import MODEL_DRAFT_MARGIN, model_drafting_pays

    assert EPYC_S38.drafting_can_pay(8)          # the older gate alone kept this draft
    assert not model_drafting_pays(EPYC_S38) and not model_drafting_pays(CPU)
    assert model_drafting_pays(XEON) and model_drafting_pays(GPU)
    # the margin: a draft token a little cheaper on the same verification passes it
    cheaper = replace(EPYC_S38, draft_token_s=0.25 * 0.0438, draft_first_s=0.25 * 0.0438)
    assert model_drafting_pays(cheaper) and MODEL_DRAFT_MARGIN > 1.0


def test_only_a_verdict_near_its_margin_is_measured_again():
    """How far a table's draft-model verdict lies from its margin, unclamped by plain
    decoding: the AVX2 EPYC's (drafting 1.0002x at acceptance 0.9 against the 5% margin) is
    near and is measured three times; a table where drafting loses by far (this CPU's shape)
    or wins by far (a GPU's) is not."""
    from specee_cpp.config import NEAR_MARGIN
    from specee_cpp.speculative.variants import drafting_margin, model_drafting_pays

    assert abs(drafting_margin(EPYC_S38) - 1.0) < NEAR_MARGIN
    assert drafting_margin(CPU) < 1.0 - NEAR_MARGIN and not model_drafting_pays(CPU)
    assert drafting_margin(GPU) > 1.0 + NEAR_MARGIN and model_drafting_pays(GPU)


@pytest.mark.model
def test_gamma_auto_leaves_out_a_draft_that_pays_only_near_full_acceptance(pair, model,
                                                                          tmp_path):
    from specee_cpp.speculative.mode import SpecOptions, use_cost_model

    model.save(tmp_path / "ctl.npz")
    use_cost_model(pair, EPYC_S38)
    plain = pair.generate("def fib(n):", max_tokens=24).tokens
    for context in (False, True):
        opts = SpecOptions(gamma="auto", controller=tmp_path / "ctl.npz", context=context)
        res = pair.generate("def fib(n):", max_tokens=24, mode="spec", options=opts)
        assert res.tokens == plain
        assert not pair.draft_loaded and "gains under 5%" in res.stats.note, res.stats.note
        assert res.stats.by_source.get("model", (0, 0))[0] == 0


def test_exploration_refreshes_a_plain_policy(model):
    """Where drafting can pay but the last round said it would not, a drafted round (up to
    the longest gamma, cut by the per-token rule) is tried after `explore_every` plain steps
    (seen failing with exploration never firing)."""
    # drafting pays here only at high acceptance (draft 0.3, each verified token +0.3)
    mid = CostModel([1.0 + 0.3 * i for i in range(16)], 0.3)
    pol = policies.CostAwareGamma(model, mid, 4.85, explore_every=16)
    assert not pol.plan_is_plain
    pol.update(Outcome(8, 0, [0.05] * 8, [7.0] * 8))   # a hopeless round: predicted rates ~ 0
    plans = [pol.plan() for _ in range(40)]
    assert plans[:15] == [0] * 15 and plans[15] == 8
    assert plans.count(8) == 2 and set(plans) == {0, 8}


def test_stop_rule_stops_drafting_where_the_next_token_cannot_pay(model):
    """Verification that jumps in price past 2 tokens: the per-token rule keeps a confident
    first token but drafts no second one (seen failing with `more` always true)."""
    steep = CostModel([1.0, 1.02, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5, 3.6], 0.1)
    stop = policies.CostAwareStop(model, steep, 4.85)
    assert stop.plan() == 8
    assert stop.keep(0, 0.99, 0.05)
    assert not stop.more(0)
    flat = policies.CostAwareStop(model, GPU, 4.85)
    flat.plan()
    assert flat.keep(0, 0.99, 0.05) and flat.more(0)


@pytest.mark.model
def test_free_draft_yields_to_a_draft_model_predicted_faster(pair):
    """generate_spec gives a round to the context's free draft only if it beats the policy's
    predicted model-drafted round: with a policy predicting more than any free draft, every
    drafted round is the model's (each traced); predicting nothing, the context drafts too.
    Greedy output equals plain's either way."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.engine.steps import stream
    from specee_cpp.speculative.decode import generate_spec
    from specee_cpp.speculative.context_drafter import ContextSource

    class Predicts(policies.FixedGamma):
        def __init__(self, tps):
            super().__init__(2)
            self.tps = tps

        def predicted_tps(self):
            return self.tps

    prompt = "Repeat exactly: one two three four five six seven eight nine ten. " * 3
    toks = pair.prompt_tokens(prompt)
    # from an empty cache, as the runs below: a prefix kept from an earlier test was decoded
    # in other batches, whose arithmetic can tip a near tie (seen on the AVX2-only EPYC: the
    # first token differed)
    pair.reset()
    plain = pair.generate(prompt, max_tokens=40).tokens
    free_rounds = {}
    for tps in (float("inf"), 0.0):
        pair.reset()
        traced = []
        src = ContextSource(GPU)
        steps = list(stream(generate_spec(pair.tgt.seq, pair.dft.seq, toks, Predicts(tps),
                                          SamplingConfig(), trace=traced.append,
                                          context=src),
                            piece=pair.model.token_to_piece, is_eog=pair.model.is_eog,
                            max_tokens=40, n_prompt=len(toks)))
        assert [s.token for s in steps if s.finish_reason != "stop"] == plain
        # the context learns (Beta counts) from its own rounds only
        free_rounds[tps] = sum(a + b - 3.0 for a, b in src.beta[0])
        if tps:
            assert traced                          # the draft model drafted instead
    assert free_rounds[float("inf")] == 0          # no free draft took a round
    assert free_rounds[0.0] > 0                    # free drafts took some


def test_exploring_prices_the_drafts_catch_up():
    """An exploring round first catches the draft up on every token emitted by the plain
    steps before it; where the best round with every draft accepted saves too little over
    the tokens left to pay for that batch, the policy stays plain (seen: one exploring
    round per 64-token answer cost spec-auto ~4% on the AVX2-only EPYC, ~190 ms of catch-up
    on 17 tokens, and nothing drafted was worth it)."""
    # drafting saves at most ~5% of a plain step per token here (a draft token 0.45, each
    # verified token +0.5)
    thin = CostModel([1.0 + 0.5 * i for i in range(16)], 0.45)

    def explores(pol, behind, room):
        pol.feats = [5.0, 6.0, 0.05, 0.01, 0.0, 4.85]   # the last round hopeless
        plans = []
        for _ in range(pol.explore_every):
            plans.append(pol.plan(RoundAt(100, behind, room)))
        assert plans[:-1] == [0] * (pol.explore_every - 1)
        return plans[-1] > 0

    pol = policies.CostAwareGamma(LastRate(), thin, 4.85)
    assert pol.can_pay
    assert explores(pol, 0, None)          # in sync, a lesson over 64 tokens is worth a try
    assert not explores(pol, 16, 48)       # 16 behind: the batch costs more than it can win
    assert not explores(pol, 0, 10)        # 10 tokens left: too few to win back a loss
    # the guard learns what catching up really costs per token beyond one draft decode (in
    # plain steps as seen) and the policy prices it so: a cheap batch makes the same
    # exploration worth it
    pol.update(Outcome(1, 0, [0.1], [5.0], seconds=2.0, tried=True, catch_up=0.8, behind=16))
    assert pol.guard.catch_up_rel == pytest.approx((0.8 - 0.45) / 16)
    assert explores(pol, 16, 48)
    # where drafting pays broadly (the AMX Xeon: verify nearly flat), it explores as before
    xeon = policies.CostAwareGamma(LastRate(), XEON, 4.85)
    assert explores(xeon, 16, 48) and not explores(xeon, 16, 5)


def test_a_losing_guard_probes_where_a_generation_starts_not_after_a_long_catch_up():
    """After a verdict against drafting the guard's wait counts every step; once it is over
    mid-answer, a round that would first catch the draft up on a long stretch (the prompt it
    did not read while the guard waited, the wait's own plain steps) stays plain: such
    probes read 5-7 plain steps' worth for 7-32-token translation answers on the Ice Lake
    Xeon and then lost again. The next generation reads its prompt up front and probes."""
    pol = policies.CostAwareGamma(LastRate(), XEON, 4.85)
    sure = [0.05, 0.1, 0.99, 0.97, 0.9, 4.85]       # the last round: 90% accepted

    def plan(behind, room=60):
        pol.feats = list(sure)
        return pol.plan(RoundAt(300, behind, room))

    assert plan(40) == 8                            # not losing: a catch-up of 40 pays here
    pol.guard.wait, pol.guard.losing = 3, True      # as after a verdict against drafting
    pol.feats = [5.0, 6.0, 0.05, 0.01, 0.0, 4.85]   # the round model would not draft...
    # ...and the wait still counts the step
    assert pol.plan(RoundAt(300, 1, 60)) == 0 and pol.guard.wait == 2
    assert [plan(1), plan(1)] == [0, 0] and pol.guard.wait == 0
    assert plan(40) == 0 and pol.predicted_tps() == 0.0   # wait over, losing, far behind
    for _ in range(2 * pol.explore_every):
        assert plan(40) == 0                        # no exploring round pays it either
    assert pol.reads_prompt(RoundAt(39, 40, 60))    # a generation's start: read, probe
    assert plan(2) == 8                             # in step after the read: a probe
    pol.update(Outcome(8, 8, [0.99] * 8, [0.05] * 8, seconds=0.2, tried=True))
    assert not pol.guard.losing and plan(40) == 8   # probed: catch-ups priced as before


def test_a_new_generation_drops_the_wait_a_kept_guard_left_but_not_its_verdict(pair, model,
                                                                               tmp_path):
    """The draft model's guard is kept with the pair from one generation to the next. A
    wait left by a verdict near the end of one answer kept the next prompt unread, and the
    draft, then far behind, was not probed for that whole answer (a code prompt after chat
    ones that lost: plain, where alone it drafted at 1.6x plain). The verdict itself stays:
    the new prompt is read and probed, and a losing probe waits the doubled backoff."""
    from specee_cpp.speculative.mode import SpecOptions, draft_policy

    model.save(tmp_path / "ctl.npz")
    opts = SpecOptions(gamma="auto", controller=tmp_path / "ctl.npz")
    last = draft_policy(pair, opts, costs=GPU)
    g = last.guard
    g.wait, g.losing, g.backoff = 30, True, 32      # a verdict near the end of an answer
    nxt = draft_policy(pair, opts, costs=GPU)
    assert nxt.guard is g                           # kept with the pair
    assert (g.wait, g.losing, g.backoff) == (0, True, 32)
    nxt.feats = [0.05, 0.1, 0.99, 0.97, 0.9, 4.85]  # the last round: 90% accepted
    assert nxt.reads_prompt(RoundAt(39, 40, 60))    # read up front: the probe starts in step


class Constant(LastRate):
    """Predicts 0.8 of every gamma accepted, whatever the last round did."""

    def rates(self, feats, gammas):
        return np.full(len(gammas), 0.8)


def test_a_round_model_that_overpromises_is_corrected_by_the_rounds_it_planned():
    """The round model fitted for one draft predicts too much for another (the 16k-head
    IQ4_NL draft outside code on the Ice Lake Xeon): the accepted tokens of the rounds it
    planned scale its rates down until its rounds stop paying, gradually (one round is
    not a verdict), and back up when rounds come out as it said or as plain steps pass
    without rounds to judge (else drafting, once stopped, could never be judged again)."""
    pol = policies.CostAwareGamma(Constant(), XEON, 4.85)

    def round_(accepted):
        g = pol.plan(RoundAt(100, 1, None))
        if g:   # no guard verdict here: seconds 0, so only the correction can stop it
            pol.update(Outcome(g, accepted, [0.5] * g, [1.0] * g, tried=True))
        return g

    assert round_(2) == 8                       # 0.8 predicted: 8 tokens pay on the Xeon
    assert 0.8 < pol.correction.factor < 1.0    # one round of 2 of 8 moves it a little
    drafted = [round_(2) for _ in range(6)]
    assert drafted[:2] == [8, 8] and drafted[-1] == 0   # a run of them stops drafting
    assert pol.correction.factor < 0.7 and pol.predicted_tps() < 1.0 / XEON.plain
    low = pol.correction.factor
    for _ in range(2 * 128):   # plain steps: the evidence fades
        pol.update(Outcome(0, 0, [], []))
    assert low < pol.correction.factor < 1.0 and round_(2) == 8   # and drafting probes
    good = policies.CostAwareGamma(Constant(), XEON, 4.85)
    good.correction = pol.correction            # a pair's correction serves its next answers
    for _ in range(40):
        good.correction.observe(6.4, 7)         # rounds as the model said (and a bit more)
    assert good.correction.factor > 1.0 and good.plan() == 8
    assert good.correction.apply(np.array([0.9, 0.5])).max() <= 0.99


def test_a_predicted_round_prices_a_long_catch_up():
    """A round the round model predicts to pay still first catches the draft up on what it
    missed; far behind (a prompt it did not read while the guard held drafting back, seen
    costing ~15 plain tokens of a 64-token answer on the Ice Lake Xeon) that batch must be
    won back over the tokens left, else the round stays plain and a free draft is not
    held back for it."""
    pol = policies.CostAwareGamma(LastRate(), XEON, 4.85)
    sure = [0.05, 0.1, 0.99, 0.97, 0.9, 4.85]       # the last round: 90% accepted

    def drafts(behind, room):
        pol.feats = list(sure)
        g = pol.plan(RoundAt(300, behind, room))
        return pol.predicted_tps(), g

    tps, g = drafts(2, 60)
    assert tps > 1.0 / XEON.plain and g == 8        # in step: drafting pays, as before
    assert drafts(250, 60) == (0.0, 0)              # 250 behind at half a draft decode each
    assert drafts(100, None) == (0.0, 0)
    # the guard learns that a token of catch-up costs a fifth of a draft decode (as measured
    # on the Ice Lake Xeon); then 100 behind is worth catching up over 60 tokens, 250 not
    pol.update(Outcome(2, 2, [0.9, 0.9], [0.3, 0.3], seconds=1.0, tried=True,
                       catch_up=XEON.draft_token_s * (1 + 0.2 * 50), behind=50))
    assert pol.guard.catch_up_rel * XEON.plain == pytest.approx(0.2 * XEON.draft_token_s)
    assert drafts(100, 60)[1] == 8
    assert drafts(250, 60) == (0.0, 0)
    assert drafts(250, 5) == (0.0, 0)


def test_the_model_drafts_at_what_verification_is_seen_to_cost(model):
    """A cost-aware policy prices verification with the pair's VerifyScale (shared with the
    context drafter): where batches are seen to run dearer than the table it drafts less or
    not at all, where they run cheaper it drafts where the table said nothing could pay; the
    batches it verifies teach the scale, and the next round reads the new prices."""
    from specee_cpp.speculative.cost import VerifyScale

    def seen(ratio: float, costs=XEON, n: int = 60) -> VerifyScale:
        s = VerifyScale()
        for _ in range(n):
            s.observe(costs, 1, costs.plain)
            s.observe(costs, 4, ratio * costs.verify(4))
        return s

    def xeon(scale=None):
        p = policies.CostAwareGamma(LastRate(), XEON, 4.85)
        if scale is not None:
            p.use_scale(scale)
        p.feats = [0.05, 0.1, 0.99, 0.60, 0.60, 4.85]   # 60% of the last round accepted
        p.plan(RoundAt(100))
        return p

    assert xeon().plan() >= 4
    dear = xeon(seen(1.8))
    assert dear.costs.verify(4) > 1.5 * XEON.verify(4) and dear.plan() == 0
    assert xeon(VerifyScale()).plan() == xeon().plan()   # nothing seen: the table
    cpu = policies.CostAwareGamma(model, CPU, 4.85)
    assert cpu.plan_is_plain
    cheap = policies.CostAwareGamma(model, CPU, 4.85)
    cheap.use_scale(seen(0.5, CPU))
    assert not cheap.plan_is_plain and cheap.can_pay
    # taught by its own batches: dear ones move the prices it reads at the next round
    p = xeon(VerifyScale())
    scale = p.verify_scale
    before = p.costs.verify(4)
    for _ in range(60):
        # the batches' rows and seconds alone (no round to judge: n_drafted 0)
        p.update(Outcome(0, 0, verify_rows=1, verify_s=XEON.plain))
        p.update(Outcome(0, 0, verify_rows=4, verify_s=1.8 * XEON.verify(4)))
    assert p.costs.verify(4) == before            # read again before the next round
    p.feats = [0.05, 0.1, 0.99, 0.60, 0.60, 4.85]
    assert p.plan(RoundAt(101)) == 0
    assert p.costs.verify(4) > 1.5 * before and scale.factor(4) > 1.5


@pytest.mark.model
def test_the_loop_tells_the_policy_what_its_batches_cost(pair):
    """generate_spec reports every full-depth batch of the draft model's rounds to the
    policy (``Outcome.verify_rows`` and ``verify_s``, the verify phase's seconds) and,
    where no context drafter times them, its plain steps; a context drafter's rounds are its own."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.speculative.decode import generate_spec

    class Every3rd(policies.FixedGamma):
        def __init__(self):
            super().__init__(2)
            self.n, self.told = 0, []

        def choose(self):
            self.n += 1
            return 2 if self.n % 3 == 0 else 0

        def update(self, o):
            if o.verify_rows:
                self.told.append((o.verify_rows, o.verify_s))

    pair.reset()
    pol = Every3rd()
    steps = []
    for st in generate_spec(pair.tgt.seq, pair.dft.seq, pair.prompt_tokens("def fib(n):"),
                            pol, SamplingConfig(), max_new=30):
        steps.append(st)
        if len(steps) >= 30:
            break
    rounds = [s for s in steps[1:] if s.timings]
    # a round is told before its tokens are yielded: the last may be cut off after it
    assert len(pol.told) - len(rounds) in (0, 1)
    for (n_rows, seconds), r in zip(pol.told, rounds):
        if r.n_drafted:
            assert n_rows == r.n_drafted + 1 and seconds == r.timings["verify"]
        else:
            assert n_rows == 1 and seconds == r.timings["decode"]
    assert {n for n, _ in pol.told} == {1, 3}


def test_the_model_policy_shares_the_pairs_scale_unless_told_not_to(pair, model, tmp_path):
    """draft_policy gives auto/stop the pair's VerifyScale (the context drafter's, one per
    pair and table); ``model_scale=False`` (bench spec-auto-table) keeps the table as
    measured, and costs given with use_cost_model are never scaled."""
    from specee_cpp.engine import modes
    from specee_cpp.speculative.mode import (SpecOptions, draft_policy, forget_costs, pair_state,
                                             use_cost_model, verify_scale)

    model.save(tmp_path / "ctl.npz")
    ctl = tmp_path / "ctl.npz"
    pair_state(pair).costs = GPU   # as if measured here
    try:
        scale = verify_scale(pair, GPU)
        assert scale is not None
        assert draft_policy(pair, SpecOptions(gamma="auto", controller=ctl)).verify_scale \
            is scale
        assert draft_policy(pair, SpecOptions(gamma="stop", controller=ctl)).verify_scale \
            is scale
        from specee_cpp.bench.configs import SpecBenchOptions

        table = SpecBenchOptions(gamma="auto", controller=ctl, model_scale=False)
        assert draft_policy(pair, table).verify_scale is None
        assert "priced by the table" in modes.get("spec").describe(table)
        use_cost_model(pair, GPU)
        assert verify_scale(pair, GPU) is None
        assert draft_policy(pair, SpecOptions(gamma="auto", controller=ctl)).verify_scale \
            is None
    finally:
        forget_costs(pair)


@pytest.mark.model
def test_a_first_estimate_lets_the_draft_model_in_only_where_it_clearly_pays(pair, model,
                                                                             tmp_path,
                                                                             monkeypatch):
    """While this machine's table is measured in idle time, runs are priced by its first
    estimate (a few timed steps): the draft model drafts where the estimate says it pays
    (the GPU's shape), not where it loses (this CPU's), and the output equals plain's."""
    from specee_cpp.speculative import mode
    from specee_cpp.speculative.cost import as_table

    model.save(tmp_path / "ctl.npz")
    opts = mode.SpecOptions(gamma="auto", controller=tmp_path / "ctl.npz")
    plain = pair.generate("def fib(n):", max_tokens=24).tokens
    mode.forget_costs(pair)
    monkeypatch.setattr(mode, "deferred", lambda llm, opts: True)   # the table not measured
    state = mode.pair_state(pair)
    drafted = {}
    try:
        for name, costs in (("gpu", GPU), ("cpu", CPU)):
            state.estimate = as_table(costs)
            res = pair.generate("def fib(n):", max_tokens=24, mode="spec", options=opts)
            assert res.tokens == plain, name
            assert "first estimate" in res.stats.note, res.stats.note
            drafted[name] = res.stats.by_source.get("model")
        assert drafted["gpu"] and not drafted["cpu"]
        assert "estimated not to pay" in res.stats.note
        assert pair.draft_loaded   # kept for the measurement that refines the estimate
    finally:
        state.estimate = None


def test_an_estimate_s_verdict_is_taken_only_where_it_is_clear(monkeypatch):
    from specee_cpp.speculative import variants
    from specee_cpp.speculative.mode import estimate_verdict

    for margin, verdict in ((1.25, "pays"), (1.05, "near"), (0.95, "near"), (0.8, "loses")):
        monkeypatch.setattr(variants, "drafting_margin", lambda costs, m=margin: m)
        assert estimate_verdict(CPU) == verdict, margin

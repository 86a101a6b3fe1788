"""Predicted outputs (OpenAI's ``prediction``): the source follows the output through an
edit of the prediction and rejoins it after a divergence; greedy output with any prediction
equals plain decoding's, token for token, in every mode that takes one; usage counts are
OpenAI's; bad predictions are refused naming the field."""
from __future__ import annotations

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.errors import ContextOverflowError, SpeceeError
from specee_cpp.speculative.cost import CostModel
from specee_cpp.engine.steps import prediction_usage
from specee_cpp.speculative.prediction import Prediction, assumed_costs

PRED = list(range(100, 400))   # 300 distinct tokens: every n-gram occurs once


def test_follows_the_prediction_and_drafts_its_continuation():
    p = Prediction(PRED)
    assert p.continuation(3)[0] == [100, 101, 102]
    p.observe([100, 101, 102, 103, 104])
    toks, probs = p.continuation(4)
    assert toks == [105, 106, 107, 108]
    # inside a run the first token is priced as a run's, not as a fresh join's
    assert probs[0] == pytest.approx(p.rate(1)) and p.rate(1) > p.rate(0)


def test_rejoins_after_a_change_an_insertion_and_a_deletion():
    p = Prediction(PRED)
    p.observe([100, 101, 999])                 # a changed token: the output left at 102
    assert p.continuation(2)[0] == []          # nothing drafted until it rejoins
    p.observe([103, 104])                      # ... two tokens of the prediction again
    assert p.continuation(2)[0] == [105, 106]
    p.observe([105, 7, 8, 9, 10])              # an insertion
    assert p.continuation(1)[0] == []
    p.observe([106, 107])                      # rejoined where it left
    assert p.continuation(1)[0] == [108]
    p.observe([108, 130, 131])                 # a deletion of 109..129, within reach
    assert p.continuation(1)[0] == [132]


def test_a_moved_block_rejoins_on_a_longer_gram_and_chance_pairs_do_not():
    p = Prediction(PRED)
    p.observe([100, 101, 102, 0])              # left at 103
    p.observe([350, 351])                      # a pair far ahead: not trusted alone
    assert p.continuation(1)[0] == []
    p.observe([352, 353])                      # four tokens of it: a moved block
    assert p.continuation(1)[0] == [354]
    q = Prediction(PRED)
    q.observe([5, 6, 7, 8, 9, 10, 11, 12])     # unrelated output never joins
    assert q.at is None and q.continuation(4)[0] == []


def test_rates_are_learned_per_answer():
    p = Prediction(PRED)
    before = p.rate(0)
    for _ in range(5):                         # fresh joins that break at once
        p.continuation(4)
        p.learn(4, 0)
    assert p.rate(0) < before / 2
    p.observe([100, 101, 102, 103, 104])
    p.continuation(8)
    run = p.rate(1)
    p.learn(8, 8)
    assert p.rate(1) > run


def test_a_token_is_priced_by_how_far_into_a_run_it_comes():
    """A run's first tokens break far more often than its later ones (an edit's changes
    cluster): each drafted token takes the rate of the run length it will come at, and a
    round's outcome is learned in those bands."""
    from specee_cpp.config import PREDICTION_BANDS

    deep = PREDICTION_BANDS[2]
    p = Prediction(PRED)
    p.observe(PRED[:deep - 2])                 # two tokens short of the deepest band
    toks, probs = p.continuation(4)
    assert toks == PRED[deep - 2:deep + 2]
    assert list(probs) == pytest.approx([p.rate(1)] * 2 + [p.rate(2)] * 2)
    assert p.rate(2) > p.rate(1) > p.rate(0)
    before = [list(b) for b in p.beta]
    p.learn(4, 3)                              # kept 2 in band 1, then 1 kept, 1 broken in 2
    assert p.beta[1] == [before[1][0] + 2, before[1][1]]
    assert p.beta[2] == [before[2][0] + 1, before[2][1] + 1]
    assert p.beta[0] == before[0]


def test_a_draft_never_outgrows_an_exact_verification(monkeypatch):
    """However long the caller's limit and however cheap the rows, a free draft stops at
    follow_max: a verification of more rows than MAX_FREE_VERIFY is not computed as
    one-token decodes are, and greedy output would no longer be plain's."""
    from specee_cpp.config import MAX_FREE_VERIFY
    from specee_cpp.speculative import context_drafter
    from specee_cpp.speculative.context_drafter import ContextSource

    flat = CostModel(target_batch_s=[1.0] * 16, draft_token_s=1.0, plain_token_s=1.0,
                     long_sizes=[MAX_FREE_VERIFY], long_batch_s=[1.0])
    monkeypatch.setattr(context_drafter, "assumed_costs", lambda: flat)
    src = ContextSource(None, prediction=Prediction(PRED), follow_max=MAX_FREE_VERIFY - 1,
                        is_eog=lambda t: False)
    assert src.plan(1, room=200) == PRED[:MAX_FREE_VERIFY - 1]
    assert src.plan(1, room=5) == PRED[:5]
    assert len(src.plan(1)) == MAX_FREE_VERIFY - 1


def test_draft_model_tokens_that_rejoin_the_prediction_bring_its_continuation():
    p = Prediction(PRED)
    p.observe(PRED[:20])
    assert p.rejoin_tail([120, 121], 3)[0] == []   # it follows the prediction: drafted as is
    p.continuation(4)                              # a round drafted deep into a run...
    p.observe([999])                               # ... which broke: left at 20
    assert p.rejoin_tail([7], 3)[0] == []
    assert p.rejoin_tail([121], 3)[0] == []        # (999, 121) is not the prediction's
    toks, probs = p.rejoin_tail([121, 122], 3)
    assert toks == [123, 124, 125]                 # priced as a rejoin of the output's own
    assert list(probs) == pytest.approx([p.rate(p.band(i)) for i in range(3)])
    assert p.at is None and p.continuation(2)[0] == []   # a draft is not the output
    before = [list(b) for b in p.beta]
    p.learn(3, 1)                                  # its tokens are learned as a rejoin's
    assert p.beta[0] == [before[0][0] + 1, before[0][1] + 1] and p.beta[1:] == before[1:]


def test_a_model_draft_that_rejoins_is_verified_with_the_prediction_after_it():
    """Where verification rows are cheap the prediction's continuation rides on the draft
    model's round, as far as it would be drafted from a rejoin and within the round's room;
    where each row costs a plain token nothing is added."""
    from specee_cpp.speculative.context_drafter import ContextSource

    cheap = CostModel([1.0 + 0.05 * i for i in range(16)], 0.1, plain_token_s=1.0,
                      long_sizes=[64], long_batch_s=[4.0])
    dear = CostModel([1.0 + i for i in range(16)], 0.1, plain_token_s=1.0)
    for costs, most in ((cheap, 63), (dear, 0)):
        src = ContextSource(costs, prediction=Prediction(PRED), is_eog=lambda t: False)
        src.extend([1, 2, 3])                      # the prompt
        src.output_began(100)
        src.extend(PRED[1:20] + [999], emitted=True)   # left the prediction at 120
        assert src.plan(6, room=100) == []         # nothing to copy, the prediction left
        assert src.rejoin([121], 100) == []
        tail = src.rejoin([121, 122], 100)
        assert tail == PRED[23:23 + len(tail)] and 0 < len(tail) <= 61 if most else tail == []
        if most:
            assert src.rejoin([121, 122], 6) == PRED[23:27]   # the round's room holds


def test_a_prediction_never_followed_for_long_adds_a_short_tail_to_a_model_draft():
    """Code shares short grams, so the draft model's tokens meet an unrelated prediction by
    chance: until the output has followed the prediction PREDICTION_TAIL_RUN tokens in a row,
    a model draft that rejoins it elsewhere than where the output left it (its start, after
    a preamble such as a code fence) brings a continuation priced as a rejoin's first token
    throughout, so a short one."""
    from specee_cpp.config import PREDICTION_TAIL_RUN

    p = Prediction(PRED)
    p.observe([7, 8])                                       # a preamble: not begun yet
    bands = [p.rate(p.band(i)) for i in range(3)]
    toks, probs = p.rejoin_tail([100, 101], 3)              # its start: the edit's text
    assert toks == [102, 103, 104] and list(probs) == pytest.approx(bands)
    toks, probs = p.rejoin_tail([105, 106], 3)              # a gram further in: maybe chance
    assert toks == [107, 108, 109] and list(probs) == pytest.approx([p.rate(0)] * 3)
    p.observe(PRED[:PREDICTION_TAIL_RUN - 1] + [999])       # followed one token short
    assert list(p.rejoin_tail(PRED[12:14], 3)[1]) == pytest.approx([p.rate(0)] * 3)
    p.observe(PRED[12:2 * PREDICTION_TAIL_RUN + 2] + [999])   # and now long enough
    at = 2 * PREDICTION_TAIL_RUN + 3
    toks, probs = p.rejoin_tail(PRED[at:at + 2], 3)
    assert toks == PRED[at + 2:at + 5] and list(probs) == pytest.approx(bands)


# an edit's original where one token (50) recurs: a rename changes it everywhere
REN = [10, 11, 12, 50, 13, 14, 15, 16, 50, 17, 18, 19, 20, 50, 21, 22, 23, 24]


def test_a_substitution_is_learned_and_drafted_where_its_span_recurs():
    p = Prediction(REN)
    p.observe([10, 11, 12, 90, 91, 13, 14])    # 50 -> 90 91, rejoined on 13 14
    assert p.subs == {}                        # not before the rejoin holds
    p.observe([15])
    assert p.continuation(6)[0] == [16, 90, 91, 17, 18, 19]
    run = p.run
    p.observe([16, 90, 91, 17])                # made again: followed, no break
    assert p.run == run + 4 and p.continuation(5)[0] == [18, 19, 20, 90, 91]


def test_a_substitution_the_output_does_not_repeat_is_dropped():
    p = Prediction(REN)
    p.observe([10, 11, 12, 90, 91, 13, 14, 15, 16])
    run = p.run
    p.observe([50])                            # the original where it was expected
    assert p.run == run + 1 and p.continuation(3)[0] == [17, 18, 19]
    p.observe([17, 18, 19, 20])
    assert p.continuation(2)[0] == [50, 21]    # no longer drafted


def test_chance_rejoins_and_rewrites_teach_no_substitution():
    p = Prediction(REN)
    p.observe([10, 11, 12, 90, 91, 13, 14, 77])   # the rejoin broke at once
    assert p.subs == {}
    q = Prediction(PRED)
    q.observe([100, 101, 7, 8, 106, 107, 108])    # four tokens rewritten: no rename
    assert q.continuation(1)[0] == [109] and q.subs == {}


def test_assumed_costs_pay_only_for_likely_runs():
    from specee_cpp.speculative.context_drafter import best_prefix
    import numpy as np

    costs = assumed_costs()
    assert costs.verify(16) == pytest.approx(1 + 0.5 * 15)
    g_sure, _ = best_prefix(1 + np.cumsum(np.cumprod(np.full(63, 0.98))), costs)
    g_coin, _ = best_prefix(1 + np.cumsum(np.cumprod(np.full(63, 0.3))), costs)
    assert g_sure >= 8 and g_coin == 0


def test_a_prediction_s_draft_ends_at_the_end_of_generation():
    """A prediction given as token ids may hold an end-of-generation token: no draft runs
    past it (rows after it would be verified for nothing)."""
    from specee_cpp.speculative.context_drafter import ContextSource

    def drafts(is_eog) -> list[list[int]]:
        src = ContextSource(None, prediction=Prediction(PRED), follow_max=63, is_eog=is_eog)
        src.output_began(100)
        out = []
        for _ in range(3):                     # each draft kept whole, then the target's own
            out.append(src.plan(10))
            src.update(len(out[-1]), len(out[-1]))
            src.extend(out[-1] + [out[-1][-1] + 1], emitted=True)
        return out

    assert drafts(None)[-1] == [108, 109, 110, 111]
    assert drafts(lambda t: t == 110)[-1] == [108, 109, 110]


def test_usage_counts_are_openais():
    assert prediction_usage([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 0)
    assert prediction_usage([1, 2, 3, 4], [9, 1, 2, 7, 4]) == (3, 1)
    assert prediction_usage([1, 2, 3], []) == (0, 3)
    assert prediction_usage([], [1, 2]) == (0, 0)


# ---- on the real small model -------------------------------------------------------------

PROMPT = "List the first ten prime numbers, one per line, each followed by a short fact."
N = 64
# verification a little dearer per row than on an AMX Xeon: long drafts pay where they are
# likely to hold
COSTS = CostModel([0.034 * x for x in (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)],
                  0.015, long_sizes=[64], long_batch_s=[0.034 * 8.0])


@pytest.fixture(scope="module")
def pair(small_model):
    from specee_cpp.engine.draft_attention import use_draft_attention

    llm = LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=1024, n_threads=2))
    use_draft_attention(llm, None)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def plain(pair):
    return pair.generate(PROMPT, max_tokens=N)


def edited(tokens: list[int]) -> list[int]:
    """A prediction that differs from the output as an edit's original does: a token
    changed, a stretch inserted, a stretch deleted."""
    t = list(tokens)
    return t[:8] + [t[8] + 1] + t[9:20] + t[40:44] + t[20:36] + t[48:]


def renamed(tokens: list[int]) -> list[int]:
    """A prediction the output renames: its most frequent token (after the first) stands
    for another one everywhere, as a variable's old name does in an edit's original."""
    t = list(tokens)
    old = max(set(t[1:]), key=t[1:].count)
    assert t.count(old) >= 3
    new = max(t) + 1
    return [new if x == old else x for x in t]


@pytest.mark.model
@pytest.mark.parametrize("kind", ["matching", "partly", "renamed", "unrelated"])
def test_greedy_output_with_a_prediction_equals_plain(pair, plain, kind):
    from specee_cpp.speculative.mode import SpecOptions, use_cost_model

    pred = {"matching": plain.tokens, "partly": edited(plain.tokens),
            "renamed": renamed(plain.tokens),
            "unrelated": pair.prediction_tokens("The committee met on Tuesday to discuss the "
                                                "budget, the new library and the parking.")}[kind]
    use_cost_model(pair, COSTS)
    runs = {"plain": {}, "spec-2": {"mode": "spec", "gamma": 2},
            "spec-auto": {"mode": "spec", "options": SpecOptions(gamma="auto")}}
    for name, kw in runs.items():
        res = pair.generate(PROMPT, max_tokens=N, prediction=pred, **kw)
        assert res.tokens == plain.tokens, (kind, name)
        drafted, accepted = res.stats.by_source.get("prediction", (0, 0))
        accepted_usage, rejected_usage = res.stats.prediction
        assert accepted_usage + rejected_usage == len(pred)
        if kind == "matching":
            # most tokens come from the prediction's drafts (each round adds the target's
            # own), none drafted for nothing
            assert accepted >= 0.75 * N and drafted == accepted, (name, res.stats.by_source)
            assert (accepted_usage, rejected_usage) == (N, 0)
        elif kind == "partly":
            assert accepted >= 0.45 * N, (name, res.stats.by_source)   # ~6 tokens a rejoin
            if name == "spec-2":
                # the draft model's tokens that rejoin the prediction are verified with its
                # continuation in the same batch
                assert "model+prediction" in res.stats.by_source, res.stats.by_source
            assert rejected_usage == len(pred) - accepted_usage > 0
        elif kind == "renamed":
            # drafted through the renamed token (without: 4-16 accepted)
            assert accepted >= 0.45 * N, (name, res.stats.by_source)
        else:
            assert drafted <= 8, (name, res.stats.by_source)


@pytest.mark.model
def test_a_prediction_as_text_and_stream_counts(pair, plain):
    steps = list(pair.stream(PROMPT, max_tokens=N, prediction=plain.text))
    assert [s.token for s in steps] == plain.tokens
    accepted, rejected = steps[-1].stats.prediction
    assert accepted >= N - 4 and rejected <= 4   # the text may tokenize apart at its edges
    assert steps[-1].stats.as_dict()["prediction"] == {"accepted": accepted,
                                                      "rejected": rejected}


@pytest.mark.model
def test_bad_predictions_are_refused_naming_the_field(pair):
    with pytest.raises(SpeceeError, match="prediction: mode spec-ee does not take one .*: "
                                          "plain, spec, ee"):
        pair.generate(PROMPT, max_tokens=4, prediction="x", mode="spec-ee")
    with pytest.raises(ContextOverflowError, match="prediction of .* tokens is longer than"):
        pair.generate(PROMPT, max_tokens=4, prediction=[1] * 2000)
    with pytest.raises(SpeceeError, match="prediction: token id"):
        pair.generate(PROMPT, max_tokens=4, prediction=[10 ** 9])
    with pytest.raises(SpeceeError, match="prediction: text or a list of token ids"):
        pair.generate(PROMPT, max_tokens=4, prediction={"type": "content"})

"""The free drafter from the context: the suffix trie's counts and proposals, and spec
decoding with it staying lossless."""
from __future__ import annotations

import pytest

from specee_cpp.spec.cost import CostModel
from specee_cpp.spec.suffix import ContextSource, SuffixTrie

FLAT = CostModel([1.0 + 0.02 * i for i in range(16)], 0.1)       # a GPU's verification
STEEP = CostModel([1.0 + 0.8 * i for i in range(16)], 0.6)       # this CPU's, roughly


def test_trie_counts_substrings_up_to_its_depth():
    t = SuffixTrie(depth=3)
    t.extend([1, 2, 3, 1, 2, 4])
    node = t._node([1, 2])
    assert t.count[node] == 2 and sorted(t.kids[node]) == [3, 4]
    assert t._node([1, 2, 3]) is not None and t._node([2, 3, 1, 2]) is None  # depth 3
    assert t.count[t._node([2])] == 2 and t.count[0] == 0


def test_proposal_continues_the_most_frequent_earlier_match():
    t = SuffixTrie(depth=4)
    text = [5, 6, 7, 8, 9, 5, 6, 7, 8, 1, 5, 6, 7, 8, 9, 5, 6]
    t.extend(text)
    p = t.propose(4)
    # "9 5 6" occurred before (followed by 7); "6 7 8" was followed by 9 twice, by 1 once
    assert p.tokens[:3] == [7, 8, 9] and p.match == 3
    assert p.probs[0] == 1.0 and p.probs[2] == pytest.approx(2 / 3)
    assert SuffixTrie(4).propose(4).tokens == []                 # nothing seen
    fresh = SuffixTrie(4)
    fresh.extend([1, 2, 3, 4])
    assert fresh.propose(4).tokens == []                          # no earlier match


def test_context_source_drafts_only_where_it_pays():
    text = list(range(20, 40)) * 3 + list(range(20, 25))
    flat, steep = ContextSource(FLAT), ContextSource(STEEP)
    for s in (flat, steep):
        s.extend(text)
    drafted = flat.plan(len(text))
    want = (list(range(25, 40)) + list(range(20, 40)))[:len(drafted)]   # the cycle goes on
    assert drafted == want and len(drafted) >= 4
    # steep verification: a draft of shares 1.0 still pays a little for a short prefix;
    # after its drafts keep being rejected the calibration stops it
    for _ in range(12):
        steep.plan(len(text))
        steep.update(4, 0)
    assert steep.plan(len(text)) == []


@pytest.mark.model
def test_spec_with_context_drafts_equals_plain(small_llm):
    """Lossless: free drafts verified by the target give plain's greedy tokens (with
    rejections: the repeated list is broken off where the drafter expects it to go on)."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.engine.steps import stream
    from specee_cpp.spec.decode import generate_spec
    from specee_cpp.spec.policies import FixedGamma

    prompt = ("Repeat this list exactly three times, separated by blank lines:\n"
              "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon\n")
    toks = small_llm.prompt_tokens(prompt)
    plain = small_llm.generate(prompt, max_tokens=60)
    small_llm.reset()
    steps = list(stream(generate_spec(small_llm.tgt.seq, None, toks, FixedGamma(0),
                                      SamplingConfig(), context=ContextSource(FLAT)),
                        piece=small_llm.model.token_to_piece, is_eog=small_llm.model.is_eog,
                        max_tokens=60, n_prompt=len(toks)))
    got = [s.token for s in steps if s.finish_reason != "stop"]
    st = steps[-1].stats
    assert got == plain.tokens
    assert st.n_drafted > 10 and st.n_accept > 0      # the context drafted, and was verified

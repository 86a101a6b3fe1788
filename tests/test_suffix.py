"""The free drafter from the context: the suffix trie's counts and proposals, and spec
decoding with it staying lossless."""
from __future__ import annotations

import pytest

from specee_cpp.speculative.cost import CostModel
from specee_cpp.speculative.context_drafter import ContextSource, SuffixTrie

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


def test_short_context_drafts_that_lose_are_held_back():
    """Where short context drafts keep running slower than plain steps (the copy model
    promising more than this work gives), their guard holds them back for a while, then
    lets them probe again."""
    from specee_cpp.speculative.policies import Guard

    text = list(range(20, 40)) * 3 + list(range(20, 25))
    src = ContextSource(FLAT, guard=Guard(plain_tps_prior=1.0, window=2, first_backoff=4))
    src.extend(text)
    for _ in range(4):
        src.plain_step(1.0)                       # plain decoding: 1 token a second
    for _ in range(2):
        d = src.plan(len(text))
        assert d and not src.in_long_copy()
        src.update(len(d), 0, seconds=2.0)        # 1 token in 2 s: slower than plain
    assert [src.plan(len(text)) for _ in range(4)] == [[]] * 4
    assert src.plan(len(text))                    # the wait is over: a probe
    free = ContextSource(FLAT)                    # no guard: never held back
    free.extend(text)
    for _ in range(6):
        free.update(len(free.plan(len(text))), 0, seconds=2.0)
    assert free.plan(len(text))


@pytest.mark.model
def test_spec_with_context_drafts_equals_plain(small_llm):
    """Lossless: free drafts verified by the target give plain's greedy tokens (with
    rejections: the repeated list is broken off where the drafter expects it to go on), and
    no round drafts past max_tokens, and the copy model's replay of the drafter's rounds
    matches the real run exactly, the round that drafts the end of the answer included."""
    from specee_cpp.config import SamplingConfig
    from specee_cpp.engine.steps import stream
    from specee_cpp.speculative.context_acceptance import simulate
    from specee_cpp.speculative.decode import generate_spec
    from specee_cpp.speculative.policies import FixedGamma

    prompt = ("Repeat this list exactly three times, separated by blank lines:\n"
              "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon\n")
    toks = small_llm.prompt_tokens(prompt)
    is_eog = small_llm.model.is_eog
    # the answer is the list once (23 tokens) and its end: at a limit of 20 the third round,
    # unbounded, would draft the list on past the limit; at 30 a round copies the prompt's
    # end of turn after the list, and the answer ends inside that round
    for n in (20, 30):
        small_llm.reset()
        plain = small_llm.generate(prompt, max_tokens=n)
        small_llm.reset()
        context = ContextSource(FLAT, is_eog=is_eog)
        steps = list(stream(generate_spec(small_llm.tgt.seq, None, toks, FixedGamma(0),
                                          SamplingConfig(), context=context, max_new=n,
                                          is_eog=is_eog),
                            piece=small_llm.model.token_to_piece, is_eog=is_eog,
                            max_tokens=n, n_prompt=len(toks)))
        got = [s.token for s in steps if s.finish_reason != "stop"]
        st = steps[-1].stats
        assert got == plain.tokens
        assert st.finish_reason == plain.stats.finish_reason == ("length" if n == 20 else "stop")
        assert st.n_drafted > 10 and st.n_accept > 0      # the context drafted, was verified
        assert st.by_source == {"context": [st.n_drafted, st.n_accept]}
        for i, s in enumerate(steps):                 # a round's last step carries its counts
            if s.n_drafted:
                emitted_before = i - s.n_accept
                assert s.n_drafted <= n - emitted_before - 1, (i, s.n_drafted)
        # the copy model's replay (speculative/context_acceptance.py) is exact: on plain's
        # greedy output, its end included, it drafts and accepts what the real run did
        out = plain.tokens + [steps[-1].token] * (st.finish_reason == "stop")
        sim = simulate(toks, out, FLAT, limit=n, is_eog=is_eog)
        assert (st.n_accept, st.n_drafted) == (sim.accepted, sim.drafted), n


# ---- the opt-in history of earlier outputs ------------------------------------------------

def test_history_store_is_bounded_and_survives_a_torn_file(tmp_path):
    from specee_cpp.speculative.history import History

    h = History("fp", max_tokens=10, directory=tmp_path)
    assert h.outputs() == [] and len(h.trie()) == 0
    h.add([1, 2, 3])
    h.add([])                                # nothing to keep
    h.add([4, 5, 6, 7])
    assert h.outputs() == [[1, 2, 3], [4, 5, 6, 7]]
    h.add([8, 9, 10, 11, 12])                # 12 tokens > 10: the oldest output goes
    assert h.outputs() == [[4, 5, 6, 7], [8, 9, 10, 11, 12]]
    h.add(list(range(100, 130)))             # longer than the bound: its last 10 tokens
    assert h.outputs() == [list(range(120, 130))]
    assert not list(tmp_path.glob("*.tmp"))  # written under a temporary name, then renamed
    # a write cut short (no final separator) loses only the torn output
    with open(h.path, "ab") as f:
        f.write(bytes([7, 0, 0, 0]))
    assert h.outputs() == [list(range(120, 130))]
    h.path.write_bytes(b"\x01\x02\x03")      # not whole int32s: treated as empty
    assert h.outputs() == []


def test_history_trie_has_no_substring_across_two_outputs(tmp_path):
    from specee_cpp.speculative.history import History

    h = History("fp", directory=tmp_path)
    h.add([1, 2, 3])
    h.add([4, 5, 6])
    t = h.trie(depth=4)
    assert t._node([2, 3]) is not None and t._node([5, 6]) is not None
    assert t._node([3, 4]) is None            # the boundary is cut
    # a context ending in "1 2" is continued from the history
    p = t.propose(4, ctx=[9, 9, 1, 2])
    assert p.tokens == [3] and p.match == 2


def test_context_source_prefers_the_longer_match_of_the_history():
    hist = SuffixTrie(8)
    hist.extend([10, 11, 12, 13, 14, 15, 16])
    src = ContextSource(FLAT, history=hist)
    src.extend([1, 2, 10, 11, 12])            # the context itself has no earlier match
    assert src.plan(100) == [13, 14, 15, 16]
    assert src._src == 1
    src.update(4, 4)
    assert src.beta[1][src._band][0] == 6.0 and src.beta[0] == [[2.0, 1.0]] * 3


def test_spec_with_history_drafts_earlier_outputs_and_stays_lossless(small_model, tmp_path,
                                                                     monkeypatch):
    """A second session asking the same gets its earlier answer as free drafts (accepted),
    with plain's greedy tokens; the store is under $SPECEE_CPP_HOME/history only."""
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.errors import SpeceeError
    from specee_cpp.speculative.mode import SpecOptions, use_cost_model

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    prompt = "Write a short poem about a lighthouse keeper."
    runs = []
    for _ in range(2):   # two sessions: a fresh LLM each
        with LLM(small_model, draft=small_model,
                 config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
            plain = llm.generate(prompt, max_tokens=48).tokens
            llm.reset()
            use_cost_model(llm, FLAT)
            runs.append(llm.generate(prompt, max_tokens=48, mode="spec",
                                     options=SpecOptions(history=True)))
            assert runs[-1].tokens == plain
    files = list((tmp_path / "history").glob("*.tokens"))
    assert len(files) == 1
    first, second = (r.stats for r in runs)
    assert "earlier output tokens" in second.note
    # the first answer, drafted for free and accepted (the context alone guessed poorly)
    assert second.n_accept >= 20 and second.acceptance > 0.9
    assert second.acceptance > first.acceptance + 0.3
    # the stats say who drafted: most of the second answer came from the history
    assert sum(d for d, _ in second.by_source.values()) == second.n_drafted
    assert second.by_source["history"][1] >= 20
    with pytest.raises(SpeceeError, match="--history"):
        SpecOptions(gamma=4, history=True)
    with pytest.raises(SpeceeError, match="--no-context"):
        SpecOptions(context=False, history=True)

"""Speculative decoding: acceptance rule, greedy equivalence on a real model, and the output
distribution under sampling on tiny models."""
import numpy as np
import pytest

from specee_cpp.config import LoadConfig, SamplingConfig
from specee_cpp.engine.draft_attention import use_draft_attention
from specee_cpp.engine.llm import LLM
from specee_cpp.speculative.decode import accept_drafts
from specee_cpp.errors import SpeceeError
from tiny_gguf import write_tiny_model

PROMPTS = ["Write a Python function that reverses a string.",
           "What is the capital of Italy? Answer in one sentence.",
           "List three prime numbers and explain why they are prime.",
           "Translate 'good morning' into French and Spanish.",
           "def fib(n):"]


def test_greedy_acceptance_rule():
    p = np.eye(5)[[1, 2, 3, 4]]            # target argmax 1, 2, 3 after each prefix, bonus 4
    rng = np.random.default_rng(0)
    assert accept_drafts([1, 2, 3], [None] * 3, p, rng, True) == (3, 4)
    assert accept_drafts([1, 0, 3], [None] * 3, p, rng, True) == (1, 2)
    assert accept_drafts([0, 2, 3], [None] * 3, p, rng, True) == (0, 1)


def test_rejection_sampling_gives_target_distribution():
    """One drafted position: the emitted token (accepted draft or resample) is ~ p."""
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
    q = np.array([0.1, 0.1, 0.3, 0.2, 0.3])
    counts = np.zeros(5)
    for _ in range(20000):
        x = int(rng.choice(5, p=q))
        n, tok = accept_drafts([x], [q], np.stack([p, np.full(5, 0.2)]), rng, False)
        counts[x if n == 1 else tok] += 1
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)


@pytest.fixture(scope="module")
def random_draft(small_model, tmp_path_factory):
    """A random tiny model with SmolLM2's tokenizer: rejects often, exercising every path."""
    path = tmp_path_factory.mktemp("draft") / "random-smol-draft.gguf"
    return write_tiny_model(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                            seed=7, vocab_from=small_model)


@pytest.mark.parametrize("draft_kind", ["random", "same"])
def test_greedy_spec_equals_plain(small_model, random_draft, draft_kind):
    draft = random_draft if draft_kind == "random" else small_model
    with LLM(small_model, draft=draft, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        if draft_kind == "same":   # the target's own attention: the same numerics as it
            use_draft_attention(llm, None)
        for prompt in PROMPTS:
            plain = llm.generate(prompt, max_tokens=40)
            for gamma in (1, 3, 5):
                spec = llm.generate(prompt, max_tokens=40, mode="spec", gamma=gamma)
                assert spec.tokens == plain.tokens, (prompt, gamma)
                st = spec.stats
                assert st.n_drafted > 0 and 0 <= st.n_accept <= st.n_drafted
                if draft_kind == "same":
                    assert st.acceptance > 0.9


def test_spec_sampling_matches_target_distribution(tmp_path):
    """Second-token marginal under sampling: spec (random draft) vs plain, tiny models."""
    tgt = write_tiny_model(tmp_path / "t.gguf", seed=11)
    dft = write_tiny_model(tmp_path / "d.gguf", seed=12)
    cfg = dict(temperature=1.0, top_k=6)
    hist = {"plain": np.zeros(400), "spec": np.zeros(400)}
    with LLM(tgt, draft=dft, config=LoadConfig(n_ctx=64, n_batch=16, n_threads=1)) as llm:
        for seed in range(2000):
            for mode in hist:
                r = llm.generate("the cat", max_tokens=2, chat=False, mode=mode,
                                 sampling=SamplingConfig(seed=seed, **cfg),
                                 **({"gamma": 3} if mode == "spec" else {}))
                hist[mode][r.tokens[-1]] += 1
    a, b = hist["plain"] / 2000, hist["spec"] / 2000
    assert 0.5 * np.abs(a - b).sum() < 0.1


def test_spec_errors(small_llm):
    with pytest.raises(SpeceeError, match="needs a draft"):
        small_llm.generate("hi", max_tokens=2, mode="spec")


def test_phases_nest_exclusively():
    from specee_cpp.speculative.decode import Phases

    t = iter([0.0, 1.0, 1.5, 3.0, 10.0, 10.25])
    ph = Phases(clock=lambda: next(t))
    with ph("draft"):          # 0.0 .. 3.0, minus the 0.5 s of control inside
        with ph("control"):    # 1.0 .. 1.5
            pass
    with ph("verify"):         # 10.0 .. 10.25
        pass
    assert ph.seconds == {"draft": 2.5, "control": 0.5, "verify": 0.25}


def test_a_run_that_will_not_draft_does_not_load_the_draft(small_model, random_draft):
    """The draft loads on first use; the cost-aware default that decides not to draft (here:
    no controller fitted for this draft) runs plain decoding and leaves it out of memory."""
    with LLM(small_model, draft=random_draft, config=LoadConfig(n_ctx=512, n_threads=2)) as llm:
        assert not llm.draft_loaded
        r = llm.generate("hi", max_tokens=4, mode="spec")
        assert not llm.draft_loaded and "no draft-length controller" in r.stats.note
        assert r.tokens == llm.generate("hi", max_tokens=4).tokens
        r = llm.generate("hi", max_tokens=4, mode="spec", gamma=2)
        assert llm.draft_loaded and r.stats.n_drafted > 0
        llm.release_draft()
        assert not llm.draft_loaded


def test_a_model_draft_ends_at_the_end_of_generation(small_model):
    """With the target as its own draft, a round that drafts the answer's end-of-turn token
    stops drafting there (rows after it would be verified for nothing)."""
    from specee_cpp.speculative.decode import generate_spec
    from specee_cpp.speculative.policies import FixedGamma

    def after_end(llm, gamma: int, is_eog) -> int | None:
        """Tokens drafted after the end in the round that drafted it (None: the end was the
        target's own token, not a drafted one)."""
        llm.reset()
        toks = llm.prompt_tokens("Reply with one word: what colour is the sky?")
        steps, end = [], None
        for step in generate_spec(llm.tgt.seq, llm.dft.seq, toks, FixedGamma(gamma),
                                  SamplingConfig(), is_eog=is_eog):
            steps.append(step)
            if end is None and llm.model.is_eog(step.token):
                end = len(steps) - 1
            if (end is not None and step.timings) or len(steps) > 60:
                break
        # the round whose accepted drafts hold the end: its last step (the one with the
        # round's timings and counts) comes later
        last = next(i for i in range(end, len(steps)) if steps[i].timings)
        start = last - steps[last].n_accept       # its first drafted token's step
        if not start <= end < last:
            return None
        return steps[last].n_drafted - (end - start + 1)

    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=512, n_threads=2)) as llm:
        is_eog = llm.model.is_eog
        cases = [(g, after_end(llm, g, None)) for g in (3, 5, 8)]
        past = [g for g, n in cases if n]
        assert past, cases      # some gamma drafts on past the end without the test
        for g in past:
            assert after_end(llm, g, is_eog) == 0, g

"""Mode spec-ee (hyper-token exit in speculative verification) on SmolLM2-135M: with exits
off it is ``--mode spec`` token for token; with exits on, whole batches exit and the cache
stays consistent."""
import pytest

from specee_cpp.config import LoadConfig, SamplingConfig
from specee_cpp.early_exit.calibrate import CalibConfig, calibrate
from specee_cpp.early_exit.candidates import DraftCandidates
from specee_cpp.early_exit.predictor import Predictors
from specee_cpp.engine.llm import LLM
from specee_cpp.errors import SpeceeError
from specee_cpp.spec_ee.mode import SpecEEOptions
from specee_cpp.spec_ee.verify import decisive
from specee_cpp.engine.draft_attention import use_draft_attention
from specee_cpp.speculative.mode import SpecOptions
from tiny_gguf import write_tiny_model

CALIB = [
    "Repeat this list three times: apple, banana, cherry, apple, banana, cherry.",
    "Write a Python function add(a, b) and call add twice.",
    "Count from one to twenty in words.",
    "Spell the word 'banana' letter by letter, then again.",
    "List the days of the week, twice.",
]
# held out from calibration
PROMPTS = ["Write a Python function that reverses a string.",
           "What is the capital of Italy? Answer in one sentence.",
           "List three prime numbers and explain why they are prime."]
N = 40
# a prompt whose answer exits: not CALIB[0], whose greedy answer on some machines (the AVX2-only
# EPYC) is "Apple, Banana, Cherry, ..." over and over, a loop that spec-ee verifies at full
# depth by design (spec_ee/verify.py: looping), so nothing exits there and nothing is tested
EXITS = PROMPTS[2]


def test_the_rows_that_decide_a_round():
    drafted = [7, 1, 2, 3]   # last emitted token 7, then drafts 1 2 3: rows 0..3
    # every row settled and agreeing: all drafts kept, the bonus row decides too
    assert decisive([True] * 4, [1, 2, 3, 9], drafted)
    assert not decisive([True, True, True, False], [1, 2, 3, 9], drafted)
    # row 1 rejects draft 2: rows 0 and 1 decide, rows 2 and 3 do not matter
    assert decisive([True, True, False, False], [1, 5, 0, 0], drafted)
    assert not decisive([True, False, True, True], [1, 5, 0, 0], drafted)
    assert not decisive([False, True, True, True], [1, 2, 3, 9], drafted)


@pytest.fixture(scope="module")
def pair(small_model):
    """SmolLM2 with itself as draft: long accepted runs, so batches of several rows exit."""
    with LLM(small_model, draft=small_model, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        # the target's own attention for its copy: the same numerics, every draft accepted
        # (measured, this machine opens the draft without flash attention: near-ties differ)
        use_draft_attention(llm, None)
        yield llm


@pytest.fixture(scope="module")
def bundle(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("hyper") / "smol.draft.npz"
    calibrate(pair, DraftCandidates(pair.dft.seq, k=4), CALIB, out,
              CalibConfig(n_tokens=24, min_layer=18, epochs=20, threshold=0.3, val_frac=0.4))
    return out


@pytest.fixture(scope="module")
def random_draft(small_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "random-smol-draft.gguf"
    return write_tiny_model(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                            seed=7, vocab_from=small_model)


def test_exits_off_equal_spec_token_for_token(pair, bundle):
    """Threshold 1 never fires, but every scheduled layer is still probed: the staged
    verification with probes equals spec's one-batch decode (and plain)."""
    for prompt in PROMPTS:
        plain = pair.generate(prompt, max_tokens=N)
        for gamma in (1, 3):
            spec = pair.generate(prompt, max_tokens=N, mode="spec",
                                 options=SpecOptions(gamma=gamma))
            hyper = pair.generate(prompt, max_tokens=N, mode="spec-ee",
                                  options=SpecEEOptions(gamma=gamma, predictors=bundle,
                                                        threshold=1.0))
            assert hyper.tokens == spec.tokens == plain.tokens, (prompt, gamma)
            assert hyper.stats.exit_layers == {}
            assert hyper.stats.n_drafted == spec.stats.n_drafted > 0
            assert hyper.stats.n_accept == spec.stats.n_accept


def test_exits_off_equal_spec_with_a_draft_that_is_rejected(small_model, random_draft, bundle):
    """A random draft: rejections at every row, short rounds, the last row's extra draft
    step and the draft's cache cut back each round."""
    with LLM(small_model, draft=random_draft, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        for prompt in PROMPTS[:2]:
            spec = llm.generate(prompt, max_tokens=N, mode="spec", options=SpecOptions(gamma=3))
            hyper = llm.generate(prompt, max_tokens=N, mode="spec-ee",
                                 options=SpecEEOptions(gamma=3, predictors=bundle,
                                                       threshold=1.0))
            assert hyper.tokens == spec.tokens
            assert hyper.stats.n_accept == spec.stats.n_accept < spec.stats.n_drafted


@pytest.mark.parametrize("rule", ["argmax", "candidate"])
def test_batches_exit_together_and_the_cache_stays_whole(pair, bundle, small_model, rule):
    res = pair.generate(EXITS, max_tokens=48, mode="spec-ee",
                        options=SpecEEOptions(gamma=3, predictors=bundle, threshold=0.05,
                                              rule=rule, unsafe=True))
    st = res.stats
    n_exit = sum(st.exit_layers.values())
    assert n_exit > 0 and all(18 <= layer < 29 for layer in st.exit_layers)
    assert st.n_drafted > 0 and n_exit <= st.n_gen
    # later plain runs on these contexts equal those of a fresh context: every exit left
    # a complete cache (filled K/V) and every round cut both caches back
    after = [pair.generate(p, max_tokens=16).tokens for p in (EXITS, PROMPTS[0])]
    with LLM(small_model, config=LoadConfig(n_ctx=1024, n_threads=2)) as fresh:
        assert after == [fresh.generate(p, max_tokens=16).tokens for p in (EXITS, PROMPTS[0])]
    spec = pair.generate(PROMPTS[1], max_tokens=16, mode="spec", options=SpecOptions(gamma=3))
    assert spec.tokens == pair.generate(PROMPTS[1], max_tokens=16).tokens


def test_spec_ee_errors(pair, bundle, small_llm, tmp_path):
    with pytest.raises(SpeceeError, match="greedily"):
        pair.generate("hi", max_tokens=2, mode="spec-ee", sampling=SamplingConfig(temperature=1),
                      options=SpecEEOptions(predictors=bundle))
    with pytest.raises(SpeceeError, match="needs a draft"):
        small_llm.generate("hi", max_tokens=2, mode="spec-ee",
                           options=SpecEEOptions(predictors=bundle))
    with pytest.raises(SpeceeError, match="gamma must be"):
        SpecEEOptions(gamma="sometimes")
    with pytest.raises(SpeceeError, match="threshold must be"):
        SpecEEOptions(threshold=2.0)
    # an n-gram provider's bundle does not serve: the candidates here are the draft's
    ngram = tmp_path / "smol.ngram.npz"
    pred = Predictors.load(bundle)
    pred.meta["provider"] = "ngram"
    pred.save(ngram)
    with pytest.raises(SpeceeError, match="ngram provider, not draft"):
        pair.generate("hi", max_tokens=2, mode="spec-ee", options=SpecEEOptions(predictors=ngram))


def test_bench_reports_drafts_and_exits_of_spec_ee(small_model, bundle, tmp_path, monkeypatch):
    """The benchmark's record of a mode that both drafts and exits carries both."""
    import json

    from specee_cpp.bench import configs
    from specee_cpp.bench.suite import BenchOptions, run

    cfg = configs.BenchConfig("spec-ee-smol", "ours", False, mode="spec-ee", needs_draft=True,
                              options=SpecEEOptions(gamma=3, predictors=bundle, threshold=0.05,
                                                    unsafe=True))
    monkeypatch.setitem(configs.CONFIGS, cfg.name, cfg)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": [EXITS]}) + "\n")
    opts = BenchOptions(model=str(small_model), draft=str(small_model), prompts=str(prompts),
                        configs=cfg.name, per_category=1, max_tokens=32, exclude_calibration=0,
                        out=str(tmp_path / "q"), threads=2, n_ctx=512)
    s = run(opts, lambda *a: None)
    e = s["configs"][cfg.name]
    assert e["n_drafted"] > 0 and e["acceptance"] is not None
    assert e["exit_ratio"] > 0 and 18 <= e["mean_exit_layer"] < 29
    assert e["agreement"] is not None    # lossy: agreement with plain is measured

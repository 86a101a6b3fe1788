"""Reduced-vocabulary draft heads (models/head.py + patch 0007) on SmolLM2-135M.

SmolLM2 ties its head to the token embeddings, so the reduced file also exercises the cut
from token_embd into a head of its own."""
from __future__ import annotations

import numpy as np
import pytest

from specee_cpp.bindings.llama import Context, Model
from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM, resolve
from specee_cpp.engine.sequence import Sequence
from specee_cpp.errors import DecodeError, ModelFileError, SpeceeError
from specee_cpp.models.head import (HEAD_KEY, head_ids, parse_size, rank_tokens, write_gguf,
                                    write_reduced)

N_HEAD = 2048
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


@pytest.fixture(scope="module")
def ranking(small_model):
    """Tokens of some text first, then the rest by id: the prompts' own continuations
    are mostly kept, many others are not."""
    m = Model(small_model)
    text = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
            "fibonacci(n - 2)\nThe capital of France is Paris. The capital of Italy is Rome.")
    seen = list(dict.fromkeys(m.tokenize(text, add_special=False)))
    n_vocab = m.n_vocab
    m.close()
    rest = [t for t in range(n_vocab - 1, -1, -1) if t not in set(seen)]   # far ids first
    return np.array(seen + rest, dtype=np.int64)


@pytest.fixture(scope="module")
def reduced(small_model, ranking, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "smol.v2048.gguf"
    path, ids = write_reduced(small_model, out, ranking, N_HEAD)
    return path, ids


def test_head_ids_keep_control_tokens_and_the_ranking():
    ids = head_ids(np.array([9, 3, 7, 1]), 4, np.array([5]), 10)
    assert ids.tolist() == [3, 5, 7, 9]
    with pytest.raises(SpeceeError, match="not reduced"):
        head_ids(np.arange(10), 10, np.array([], dtype=np.int64), 10)


def test_rank_tokens_puts_proposals_then_the_corpus_top_then_ids():
    proposed = np.array([0, 5, 0, 0, 9, 0, 0, 0], dtype=float)
    frequency = np.array([0.1, 0.0, 0.3, 0.0, 0.2, 0.5, 0.0, 0.4])
    # proposals by count (4, 1), the corpus's top 2 of the rest (5, 7), the rest by id
    assert rank_tokens(proposed, frequency, 2).tolist() == [4, 1, 5, 7, 0, 2, 3, 6]
    # the whole corpus ranking: its zero-frequency tail by id
    assert rank_tokens(proposed, frequency, 8).tolist() == [4, 1, 5, 7, 2, 0, 3, 6]
    assert rank_tokens(np.zeros(8), np.zeros(8), 3).tolist() == list(range(8))


def test_parse_size():
    assert parse_size("v32k") == 32768 and parse_size("V8192") == 8192
    for bad in ("32k", "vx", "v8"):
        with pytest.raises(SpeceeError):
            parse_size(bad)


def test_reduced_head_logits_are_the_full_heads_rows(small_model, reduced):
    path, ids = reduced
    assert len(ids) == N_HEAD and not list(path.parent.glob("*.partial"))
    full_m, red_m = Model(small_model), Model(path)
    assert full_m.n_head == 0 and red_m.n_head == N_HEAD
    try:
        full = Sequence(Context(full_m, n_ctx=256, n_batch=64, n_threads=2))
        red = Sequence(Context(red_m, n_ctx=256, n_batch=64, n_threads=2))
        toks = full_m.tokenize(PROMPTS[0])
        full.decode(toks)
        red.decode(toks)
        a, b = full.logits(), red.logits()
        assert b.shape == a.shape
        outside = np.setdiff1d(np.arange(a.size), ids)
        assert np.all(np.isneginf(b[outside]))
        np.testing.assert_allclose(b[ids], a[ids], rtol=1e-4, atol=1e-4)
        # greedy in C picks among the kept rows, as numpy would
        assert red.argmax() == int(ids[np.argmax(a[ids])])
        # and the draft's confidence in C is the softmax over those rows only
        from specee_cpp.speculative.decode import draft_confidence

        tok, top1, ent = red.confidence()
        want_top1, want_ent = draft_confidence(a[ids])
        assert tok == red.argmax()
        assert top1 == pytest.approx(want_top1, rel=1e-3)
        assert ent == pytest.approx(want_ent, rel=1e-3, abs=1e-4)
        # the full head's over the whole vocabulary, where the C loop leaves out the terms
        # more than 24 below the max (< 1.5e-4 nats of entropy over 152k tokens)
        tok, top1, ent = full.confidence()
        want_top1, want_ent = draft_confidence(a)
        assert tok == int(np.argmax(a))
        assert top1 == pytest.approx(want_top1, rel=1e-3)
        assert ent == pytest.approx(want_ent, rel=1e-3, abs=2e-4)
        # a reduced head cannot be probed by vocabulary id: staged decodes refuse, not abort
        with pytest.raises(DecodeError, match="-1"):
            red.begin_staged(toks[:4])
    finally:
        full.ctx.close()
        red.ctx.close()
        full_m.close()
        red_m.close()


def test_greedy_spec_with_a_reduced_draft_equals_plain(small_model, reduced):
    """Lossless: the reduced draft only proposes from its rows; the target decides."""
    with LLM(small_model, draft=reduced[0], config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        for prompt in PROMPTS:
            plain = llm.generate(prompt, max_tokens=32)
            spec = llm.generate(prompt, max_tokens=32, mode="spec", gamma=3)
            assert spec.tokens == plain.tokens, prompt
            assert spec.stats.n_drafted > 0 and spec.stats.n_accept > 0


def _rewrite_ids(src, out, ids):
    """``src`` with its head-id list replaced, to feed bad lists."""
    import gguf

    reader = gguf.GGUFReader(src)
    return write_gguf(reader, out, [(t.name, t.data, t.tensor_type) for t in reader.tensors],
                      {HEAD_KEY: ids})


def test_malformed_head_lists_fail_to_load_with_the_reason(reduced, tmp_path):
    path, ids = reduced
    swapped = [int(i) for i in ids]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    with pytest.raises(ModelFileError, match="increasing"):
        Model(_rewrite_ids(path, tmp_path / "unsorted.gguf", swapped))
    # one id fewer than the head has rows
    with pytest.raises(ModelFileError, match="output.weight' has wrong shape"):
        Model(_rewrite_ids(path, tmp_path / "short.gguf", [int(i) for i in ids[:-1]]))


def test_writing_a_reduced_file_twice_and_bad_variants(small_model, reduced, ranking, tmp_path):
    with pytest.raises(SpeceeError, match="already has a reduced head"):
        write_reduced(reduced[0], tmp_path / "again.gguf", ranking, 1024)
    with pytest.raises(SpeceeError, match="NAME:TYPE:vN"):
        resolve("smollm2-135m:v4k:v8k")
    with pytest.raises(SpeceeError, match="NAME:auto is a draft"):
        resolve("smollm2-135m:auto")          # only a draft, chosen by a mode
    # SmolLM2's tokenizer has no shipped ranking: the error says how to make one
    with pytest.raises(SpeceeError, match="head_vocab.py"):
        resolve("smollm2-135m:v4k")


def test_llama_cpp_tools_get_the_full_head_a_reduced_draft_was_cut_from(small_model, ranking,
                                                                          tmp_path):
    # the bench gives llama.cpp's tools "the same draft": they cannot load a reduced head,
    # so they get its source, found by the name reduced_variant gives it
    import shutil

    from specee_cpp.models.head import full_head_file

    src = tmp_path / "smol.Q4_0.gguf"
    shutil.copy(small_model, src)
    cut = tmp_path / "smol.Q4_0.v2048-0123abcd.gguf"
    write_reduced(src, cut, ranking, N_HEAD)
    assert full_head_file(cut) == src
    assert full_head_file(src) == src
    src.unlink()
    with pytest.raises(SpeceeError, match="full-head source smol.Q4_0.gguf"):
        full_head_file(cut)

"""The patched library on tiny F32 models: loading, errors, layer-input capture."""
import numpy as np
import pytest

from specee_cpp.bindings import Context, Model, library_info
from specee_cpp.engine.sequence import Sequence
from specee_cpp.errors import SpeceeError, UnsupportedArchitectureError
from specee_cpp.models.gguf_info import read_gguf_info


def test_patched_library_loaded():
    info = library_info()
    assert info["specee_patch_version"] >= 1
    assert "+specee." in info["llama_cpp_python"]


def _ctx(path, n_ctx=128):
    model = Model(path)
    return model, Context(model, n_ctx=n_ctx, n_batch=64, n_threads=1)


def test_a_closed_model_or_context_raises_instead_of_crashing(tiny_llama):
    """Used after close (a script calling the pair after its ``with`` block), the freed
    pointers would reach llama.cpp and segfault (in bits_per_weight, say)."""
    model, ctx = _ctx(tiny_llama)
    toks = model.tokenize("the cat", add_special=True)
    Sequence(ctx).decode(toks)
    ctx.close()
    with pytest.raises(SpeceeError, match="a context on model .* is closed"):
        Sequence(ctx).decode(toks)
    ctx.close()                                   # twice: nothing
    model.close()
    for use in (lambda: model.bits_per_weight, lambda: model.tokenize("the cat"),
                lambda: model.is_eog(0), lambda: model.chat_template):
        with pytest.raises(SpeceeError, match=f"model {tiny_llama.name} is closed"):
            use()
    model.close()


def test_unknown_architecture_is_one_clear_error(tiny_unknown_arch):
    with pytest.raises(UnsupportedArchitectureError, match="notanarch"):
        Model(tiny_unknown_arch)


def test_argmax_in_c_equals_numpy_on_the_logits(tiny_llama):
    model, ctx = _ctx(tiny_llama)
    seq = Sequence(ctx)
    seq.decode(model.tokenize("the cat sat on", add_special=True), all_outputs=True)
    for i in range(4):
        assert ctx.argmax(i) == int(np.argmax(ctx.logits(i)))
    assert ctx.argmax(-1) == int(np.argmax(ctx.logits(-1)))
    with pytest.raises(SpeceeError, match="no logits for output 99"):
        ctx.argmax(99)


def test_confidence_in_c_equals_numpy_on_the_logits(tiny_llama):
    """What a draft-length policy reads of each drafted token (patch 0011): the greedy token,
    the top-1 probability and the entropy of the softmax, as ``draft_confidence`` computes
    them from a copy of the logits."""
    from specee_cpp.speculative.decode import draft_confidence

    model, ctx = _ctx(tiny_llama)
    seq = Sequence(ctx)
    seq.decode(model.tokenize("the cat sat on", add_special=True), all_outputs=True)
    for i in (0, 1, 2, 3, -1):
        tok, top1, ent = ctx.confidence(i)
        lg = ctx.logits(i)
        want_top1, want_ent = draft_confidence(lg)
        assert tok == int(np.argmax(lg)) == ctx.argmax(i)
        assert top1 == pytest.approx(want_top1, rel=1e-4)
        assert ent == pytest.approx(want_ent, rel=1e-4, abs=1e-5)
        assert 0.0 < top1 <= 1.0 and ent >= 0.0
    with pytest.raises(SpeceeError, match="no logits for output 99"):
        ctx.confidence(99)


def test_the_library_says_which_architectures_it_loads():
    """Asked before loading (patch 0005), not read from llama.cpp's log: a name llama.cpp
    knows but has no model class for (gptj, in this pinned version) is refused like an
    unknown one."""
    from specee_cpp.bindings._ffi import llama_specee_arch_supported as supported

    assert supported(b"qwen2") and supported(b"llama") and supported(b"qwen3")
    assert not supported(b"notanarch") and not supported(b"(unknown)") and not supported(b"")
    assert not supported(b"gptj")


def test_tokenize_roundtrip(tiny_llama):
    model = Model(tiny_llama)
    ids = model.tokenize("the cat sat", add_special=True)
    assert ids[0] == model.bos
    text = b"".join(model.token_to_piece(t) for t in ids[1:]).decode()
    # the tiny vocabulary has no merges, so SentencePiece falls back to bytes of the escaped
    # text (spaces as U+2581)
    assert len(ids) == 1 + len("▁the▁cat▁sat".encode())
    assert text.replace("\u2581", " ").strip() == "the cat sat"
    with pytest.raises(SpeceeError, match="out of range"):
        model.token_to_piece(10_000)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_layer_input_capture(fixture, request):
    path = request.getfixturevalue(fixture)
    model, ctx = _ctx(path)
    seq = Sequence(ctx)
    prompt = model.tokenize("the dog sat on the mat")
    base = seq.prefill(prompt)

    for il in range(model.n_layer):
        ctx.set_layer_inp(il, True)
    seq.rewind(0)
    logits = seq.prefill(prompt)
    # Capture is observation only: logits stay bit-identical.
    assert np.array_equal(logits, base)
    h0 = ctx.layer_inp(0, len(prompt) - 0)
    emb = _token_embd(path)
    # The residual stream entering layer 0 is the token embedding, exactly (F32 model).
    assert np.array_equal(h0, emb[prompt])
    h1 = ctx.layer_inp(1, len(prompt))
    assert h1.shape == (len(prompt), model.n_embd) and not np.allclose(h1, h0)

    with pytest.raises(SpeceeError, match="out of range"):
        ctx.set_layer_inp(model.n_layer, True)
    ctx.set_layer_inp(1, False)
    with pytest.raises(SpeceeError, match="not captured"):
        ctx.layer_inp(1, len(prompt))


def _token_embd(path):
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    return np.asarray(t.data, dtype=np.float32).reshape(read_gguf_info(path).n_vocab, -1)


def test_sequence_rewind_and_prefix_reuse(tiny_llama):
    model, ctx = _ctx(tiny_llama)
    seq = Sequence(ctx)
    a = model.tokenize("the cat sat on the mat")
    b = model.tokenize("the cat sat on a dog")
    la = seq.prefill(a)
    lb = seq.prefill(b)  # reuses the common prefix, recomputes the rest
    fresh = Sequence(Context(model, n_ctx=128, n_batch=64, n_threads=1))
    np.testing.assert_array_equal(lb, fresh.prefill(b))
    np.testing.assert_array_equal(la, fresh.prefill(a))
    assert seq.tokens == b and fresh.tokens == a


def test_all_logits_match_one_by_one(tiny_llama):
    model, ctx = _ctx(tiny_llama)
    seq = Sequence(ctx)
    prompt = model.tokenize("hello world")
    seq.prefill(prompt)
    batch = seq.feed([5, 6, 7], all_logits=True)
    seq.rewind(len(prompt))
    singles = [seq.feed([t]) for t in (5, 6, 7)]
    np.testing.assert_allclose(batch, np.stack(singles), rtol=1e-5, atol=1e-5)


def test_flash_attention_can_be_switched_per_context(small_model):
    # the draft's attention choice times both settings: each must really be the one asked for.
    # With flash attention the CPU kernel accumulates V in f16, without it the product is in
    # f32, so the logits differ (here ~13% of their spread on SmolLM2; not at all would mean
    # the switch did nothing, a broken attention would be off by about 100%)
    from specee_cpp.bindings import Batch

    m = Model(small_model)
    out = {}
    for fa in (True, False):
        ctx = Context(m, n_ctx=256, n_batch=64, n_threads=2, flash_attn=fa)
        b = Batch(64)
        b.set(list(range(100, 160)), 0)
        ctx.decode(b)
        out[fa] = ctx.logits(-1)
        ctx.close()
    m.close()
    diff = float(np.max(np.abs(out[True] - out[False])))
    assert 0 < diff < 0.3 * float(np.std(out[False])), diff

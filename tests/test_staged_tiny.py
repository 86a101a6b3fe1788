"""The staged-decode patch (probes, mid-decode exit, filled KV) on tiny F32 models, checked
against the float64 numpy reference in reference.py."""
import numpy as np
import pytest

from reference import RefModel
from specee_cpp.bindings import Batch, Context, Model
from specee_cpp.errors import DecodeError, UnsupportedArchitectureError
from tiny_gguf import write_tiny_model

N_LAYER = 4
TOL = dict(rtol=2e-4, atol=2e-4)
PROMPT = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("staged") / f"tiny4-{request.param}.gguf"
    write_tiny_model(path, arch=request.param, n_layer=N_LAYER, seed=5)
    return Model(path), RefModel(path)


def make_ctx(model):
    return Context(model, n_ctx=64, n_batch=16, n_threads=1, exact=True)


def decode(ctx, tokens, pos0, all_logits=True):
    b = Batch(16)
    b.set(tokens, pos0, output_last_only=not all_logits)
    ctx.decode(b)
    n = len(tokens) if all_logits else 1
    return np.stack([ctx.logits(i) for i in range(n)])


def prompt_cache(ref):
    """The reference K/V cache after a full-depth pass over PROMPT."""
    cache = ref.new_cache()
    ref.forward(PROMPT, list(range(len(PROMPT))), cache)
    return cache


def begin(ctx, tokens, pos0):
    b = Batch(16)
    b.set(tokens, pos0, output_last_only=False)
    ctx.stage_begin(b)
    return b


def staged_after_prompt(model, tokens, layers):
    """A context holding PROMPT with ``tokens`` staged after it and run to ``layers``."""
    ctx = make_ctx(model)
    decode(ctx, PROMPT, 0)
    begin(ctx, tokens, len(PROMPT))
    ctx.stage_run(layers)
    return ctx


def assert_next(ctx, ref, cache, token, pos):
    """Decoding ``token`` at ``pos`` gives the reference's logits over ``cache``."""
    got = decode(ctx, [token], pos)
    want, _ = ref.forward([token], [pos], cache)
    np.testing.assert_allclose(got, want, **TOL)


def test_plain_decode_matches_reference(tiny):
    model, ref = tiny
    ctx = make_ctx(model)
    got = decode(ctx, PROMPT, 0)
    want, _ = ref.forward(PROMPT, list(range(len(PROMPT))), ref.new_cache())
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("segments", [[N_LAYER], [1, N_LAYER], [1, 2, 3, N_LAYER]])
def test_staged_to_the_end_equals_decode(tiny, segments):
    model, _ = tiny
    a, b = make_ctx(model), make_ctx(model)
    want = decode(a, PROMPT, 0)
    begin(b, PROMPT, 0)
    for il in segments:
        b.stage_run(il)
    got = np.stack([b.logits(i) for i in range(len(PROMPT))])
    assert b.stage_layer == -1
    # same ops on the same rows: bit-identical
    assert np.array_equal(got, want)
    # and the cache it leaves is the same: the next token decodes identically
    assert np.array_equal(decode(a, [50], len(PROMPT)), decode(b, [50], len(PROMPT)))


def test_staged_state_costs_nothing_until_used(tiny):
    """Plain decoding allocates nothing for the staged decode; the first stage allocates the
    residual store (one F32 row per batch slot) once."""
    model, _ = tiny
    ctx = make_ctx(model)
    assert ctx.stage_bytes() == 0
    decode(ctx, PROMPT, 0)
    assert ctx.stage_bytes() == 0
    begin(ctx, [50], len(PROMPT))
    ctx.stage_run(N_LAYER)
    held = ctx.stage_bytes()
    assert held >= model.n_embd * 16 * 4
    begin(ctx, [51, 52], len(PROMPT) + 1)
    ctx.stage_run(2)
    ctx.stage_run(N_LAYER)
    assert ctx.stage_bytes() == held


def test_repeated_segment_shapes_equal_decode_token_by_token(tiny):
    """Every token through the same alternating segment shapes (each shape's graph is kept
    and rebuilt in place, the residual kept in the store between segments) gives the
    logits of plain decoding, bit for bit, and the residual read back mid-way is the
    reference's."""
    model, ref = tiny
    a, b = make_ctx(model), make_ctx(model)
    decode(a, PROMPT, 0)
    decode(b, PROMPT, 0)
    cache = prompt_cache(ref)
    for i, token in enumerate([50, 51, 52, 53]):
        pos = len(PROMPT) + i
        want = decode(a, [token], pos)
        begin(b, [token], pos)
        b.stage_run(1)
        b.stage_run(3)
        _, hs = ref.forward([token], [pos], cache)   # also extends the reference cache
        np.testing.assert_allclose(b.stage_hidden(), hs[3], **TOL)
        b.stage_run(N_LAYER)
        assert np.array_equal(b.logits(-1), want[-1])


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_probes_and_hidden_match_reference(tiny, layer):
    model, ref = tiny
    ctx = make_ctx(model)
    pos = list(range(len(PROMPT)))
    _, hs = ref.forward(PROMPT, pos, ref.new_cache())
    cand = np.array([[3, 7, 100 + i, 200] for i in range(len(PROMPT))])
    begin(ctx, PROMPT, 0)
    probe = ctx.stage_run(layer, cand)
    np.testing.assert_allclose(ctx.stage_hidden(), hs[layer], **TOL)
    want = np.take_along_axis(ref.head(hs[layer]), cand, axis=1)
    np.testing.assert_allclose(probe, want, **TOL)
    # probes are an observation: continuing to the end gives the normal logits
    ctx.stage_run(N_LAYER)
    full, _ = ref.forward(PROMPT, pos, ref.new_cache())
    np.testing.assert_allclose(ctx.logits(-1), full[-1], **TOL)


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_exit_logits_and_filled_kv(tiny, layer):
    model, ref = tiny
    ctx = make_ctx(model)
    cache = ref.new_cache()
    n = len(PROMPT)
    ref.forward(PROMPT[:3], [0, 1, 2], cache)
    decode(ctx, PROMPT[:3], 0)

    # an exit at `layer` for a batch of several positions
    batch = PROMPT[3:]
    pos = list(range(3, n))
    begin(ctx, batch, 3)
    cand = np.tile(np.array([5, 6, 7, 8]), (len(batch), 1))
    probe = ctx.stage_run(layer, cand)
    ctx.stage_exit(full_head=True)
    got = np.stack([ctx.logits(i) for i in range(len(batch))])
    want, _ = ref.forward(batch, pos, cache, exit_layer=layer)
    np.testing.assert_allclose(got, want, **TOL)
    # the probe at the exit layer equals the exit logits at the candidate ids
    np.testing.assert_allclose(probe, np.take_along_axis(got, cand, axis=1), **TOL)

    # the next full decode sees the skipped layers' K/V built from h_layer
    nxt = decode(ctx, [60, 61], n)
    want_next, _ = ref.forward([60, 61], [n, n + 1], cache)
    np.testing.assert_allclose(nxt, want_next, **TOL)


@pytest.mark.parametrize("layer", [1, 3])
def test_head_peek_keeps_the_stage_open(tiny, layer):
    model, ref = tiny
    ctx = make_ctx(model)
    pos = list(range(len(PROMPT)))
    _, hs = ref.forward(PROMPT, pos, ref.new_cache())
    begin(ctx, PROMPT, 0)
    ctx.stage_run(layer)
    ctx.stage_head()
    peek = np.stack([ctx.logits(i) for i in range(len(PROMPT))])
    np.testing.assert_allclose(peek, ref.head(hs[layer]), **TOL)
    assert ctx.stage_layer == layer
    # the peek changes nothing: continuing gives the normal result
    ctx.stage_run(N_LAYER)
    full, _ = ref.forward(PROMPT, pos, ref.new_cache())
    np.testing.assert_allclose(ctx.logits(-1), full[-1], **TOL)
    # peek, then exit without head: the peeked logits stay the result
    ctx2 = make_ctx(model)
    begin(ctx2, PROMPT, 0)
    ctx2.stage_run(layer)
    ctx2.stage_head()
    ctx2.stage_exit(full_head=False)
    assert np.array_equal(np.stack([ctx2.logits(i) for i in range(len(PROMPT))]), peek)


def test_exit_without_head_then_seq_rm(tiny):
    model, ref = tiny
    ctx = staged_after_prompt(model, [70, 71], 2)
    ctx.stage_exit(full_head=False)
    with pytest.raises(DecodeError):
        ctx.logits(0)  # no logits without the head
    # remove the exited positions and decode other tokens there: as if they never existed
    ctx.seq_rm(len(PROMPT))
    got = decode(ctx, [72, 73], len(PROMPT))
    cache = prompt_cache(ref)
    want, _ = ref.forward([72, 73], [len(PROMPT), len(PROMPT) + 1], cache)
    np.testing.assert_allclose(got, want, **TOL)


def test_abort_and_decode_during_stage_remove_positions(tiny):
    model, ref = tiny
    ctx = staged_after_prompt(model, [80, 81], 1)
    ctx.stage_abort()
    assert ctx.stage_layer == -1
    cache = prompt_cache(ref)
    assert_next(ctx, ref, cache, 82, len(PROMPT))
    # llama_decode while a stage is open discards the stage the same way
    begin(ctx, [90], len(PROMPT) + 1)
    ctx.stage_run(2)
    assert_next(ctx, ref, cache, 83, len(PROMPT) + 1)


def test_invalid_stage_calls(tiny):
    model, _ = tiny
    ctx = make_ctx(model)
    with pytest.raises(DecodeError):
        ctx.stage_run(1)                      # no stage open
    begin(ctx, PROMPT, 0)
    with pytest.raises(DecodeError):
        ctx.stage_exit()                      # no layer run yet
    ctx.stage_run(2)
    with pytest.raises(DecodeError):
        ctx.stage_run(2)                      # not past the current layer
    with pytest.raises(DecodeError):
        ctx.stage_run(3, np.full((len(PROMPT), 2), 10**6))  # candidate id out of range
    assert ctx.stage_layer == 2               # invalid calls leave the stage as it was
    ctx.stage_abort()
    assert ctx.stage_layer == -1


def test_unsupported_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "tiny-qwen3.gguf", arch="qwen3")
    model = Model(path)
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=1)
    b = Batch(4)
    b.set([1, 2], 0)
    with pytest.raises(UnsupportedArchitectureError, match="qwen3"):
        ctx.stage_begin(b)

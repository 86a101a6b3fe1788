"""One CPU thread pool for every context (bindings.llama.shared_threadpool)."""
from __future__ import annotations

import pytest

from specee_cpp.bindings import _ffi
from specee_cpp.bindings.llama import Context, Model
from specee_cpp.engine.sequence import Sequence


def _greedy(ctx: Context, model: Model, n: int = 8) -> list[int]:
    seq = Sequence(ctx)
    out = seq.decode_greedy(model.tokenize("the cat sat on the"))[-1:]
    for _ in range(n):
        seq.decode([out[-1]])
        out.append(seq.argmax())
    return out


@pytest.mark.skipif(_ffi.ggml_cpu() is None, reason="this build's CPU backend is not a library")
def test_contexts_share_one_pool_and_decode_as_without(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_THREADPOOL", "1")     # opt-in (off by default)
    model = Model(tiny_llama)
    try:
        a = Context(model, n_ctx=128, n_batch=32, n_threads=2)
        b = Context(model, n_ctx=128, n_batch=32, n_threads=2)
        assert a.threadpool and a.threadpool == b.threadpool
        with_pool = _greedy(a, model)
        monkeypatch.setenv("SPECEE_CPP_THREADPOOL", "0")
        c = Context(model, n_ctx=128, n_batch=32, n_threads=2)
        assert c.threadpool is None
        assert _greedy(c, model) == with_pool
        for ctx in (a, b, c):
            ctx.close()
    finally:
        model.close()


def test_the_pool_is_off_by_default(tiny_llama, monkeypatch):
    monkeypatch.delenv("SPECEE_CPP_THREADPOOL", raising=False)
    model = Model(tiny_llama)
    try:
        ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
        assert ctx.threadpool is None
        ctx.close()
    finally:
        model.close()


def test_a_thread_gives_back_its_openmp_team_and_decodes_as_before(tiny_llama):
    """A server's main thread, done loading and measuring, gives back the OpenMP team it
    decoded with (more teams than cores slow every decode): where the CPU backend runs on
    OpenMP the team is released, and a decode on that thread afterwards makes a new one and
    gives the same tokens."""
    import llama_cpp as ll

    openmp = "OPENMP = 1" in ll.llama_print_system_info().decode(errors="replace")
    model = Model(tiny_llama)
    try:
        a = Context(model, n_ctx=128, n_batch=32, n_threads=2)
        before = _greedy(a, model)
        assert _ffi.release_openmp_threads() == openmp
        b = Context(model, n_ctx=128, n_batch=32, n_threads=2)
        assert _greedy(b, model) == before
        for ctx in (a, b):
            ctx.close()
    finally:
        model.close()

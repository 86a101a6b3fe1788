"""Checks on llama.cpp's real CPU kernels, run in a child process by the tests.

A kernel or scheduler bug here kills the process (SIGSEGV in a tile instruction, SIGABRT from
GGML_ASSERT), so each check runs as ``python kernel_checks.py NAME ARGS...`` and the test
reads the exit status: a crash fails one test, with its signal, instead of ending the run.

The models are tiny qwen2 GGUFs quantized by llama.cpp to Q4_0 / Q4_K / Q6_K / IQ4_NL / Q8_0
with the LM head in the same type and every row count a multiple of 16, so that with the
extra buffer types on (as users run) the weights and the head are repacked (CPU_REPACK, or
AMX where the CPU has it); the same file loaded with extra buffer types off is the
reference.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from specee_cpp.bindings import Batch, Context, Model, quantize_file  # noqa: E402
from specee_cpp.bindings._ffi import ll  # noqa: E402
from specee_cpp.errors import SpeceeError  # noqa: E402
from tiny_gguf import write_tiny_model  # noqa: E402

N_LAYER = 4
N_VOCAB = 320  # a multiple of 16: the head is repacked
PROMPT = [1, 300, 301, 302, 303, 304, 305, 306]
# name -> (llama_ftype, ggml type of head and embeddings)
QUANTS = {"Q4_0": (2, 2), "Q4_K": (14, 12), "Q6_K": (18, 14), "IQ4_NL": (25, 20), "Q8_0": (7, 8)}
# Both paths quantize activations to 8 bits per block, but repacked kernels sum in another
# order (and AMX in int32 tiles): measured up to 7% of the logits' spread (Q4_K); a broken
# kernel is off by about 100%.
REL_TOL = 0.15


# patch 0014's attention against upstream's on one-row decodes after 600 tokens: the mean
# |difference| of the logits as a fraction of their spread (measured 0.031-0.038; upstream's
# tiled attention is as far from its one-pass), and the tokens whose argmax agrees (0.94-0.96)
ATTN_MEAN_TOL = 0.06
ATTN_AGREE = 0.85


# (n_embd, n_ff, n_head): rows of one or two K-quant super-blocks (256 values), or, "wide",
# of 5 and 14, so that a kernel's step from one super-block of a row to the next is
# exercised in every projection, not only in ffn_down
SHAPES = {"narrow": (256, 512, 4), "wide": (1280, 3584, 10)}


def make_model(directory: Path, quant: str, shape: str = "narrow") -> Path:
    suffix = "" if shape == "narrow" else f"-{shape}"
    out = directory / f"rk-{quant}{suffix}.gguf"
    if not out.exists():
        f32 = directory / f"rk-f32{suffix}.gguf"
        n_embd, n_ff, n_head = SHAPES[shape]
        if not f32.exists():
            write_tiny_model(f32, arch="qwen2", n_layer=N_LAYER, n_embd=n_embd, n_head=n_head,
                             n_head_kv=2, n_ff=n_ff, seed=11,
                             extra_words=[f"▁w{i}" for i in range(N_VOCAB - 269)])
        ftype, head = QUANTS[quant]
        quantize_file(f32, out, ftype=ftype, n_threads=2, head_type=head)
    return out


def close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    spread = float(np.std(b)) or 1.0
    err = float(np.max(np.abs(a - b)))
    if os.environ.get("RK_VERBOSE"):
        print(f"{what}: {err / spread:.4f}", file=sys.stderr)
    if not np.all(np.isfinite(a)) or err > REL_TOL * spread:
        raise AssertionError(f"{what}: max |diff| {err:.4g} > {REL_TOL} x std {spread:.4g}")


def ctx_of(model: Model, n_batch: int = 16) -> Context:
    return Context(model, n_ctx=128, n_batch=n_batch, n_threads=2)


def all_logits(ctx: Context, n: int) -> np.ndarray:
    return np.stack([ctx.logits(i) for i in range(n)])


def run_pair(path: Path):
    """Everything our decoding does, on one model; returns the arrays to compare."""
    model = Model(path, use_extra_bufts=os.environ.get("RK_EXTRA", "1") == "1")
    out = {}
    ctx = ctx_of(model)
    b = Batch(16)
    b.set(PROMPT, 0, output_last_only=False)
    ctx.decode(b)
    out["prompt"] = all_logits(ctx, len(PROMPT))
    # staged: two tokens, probes at layer 2, the head there, exit with filled KV
    nxt = [307, 308]
    b.set(nxt, len(PROMPT), output_last_only=False)
    ctx.stage_begin(b)
    cand = np.array([[5, 17, 300, 319], [2, 9, 301, 310]], dtype=np.int32)
    out["probe"] = ctx.stage_run(2, cand)
    ctx.stage_head()
    head = all_logits(ctx, 2)
    out["head"] = head
    gathered = np.take_along_axis(head, cand, axis=1)
    close(out["probe"], gathered, f"{path.name}: probe vs head at layer 2")
    ctx.stage_exit(full_head=False)
    # the next token reads the K/V filled at layers 2..3
    b.set([309], len(PROMPT) + 2)
    ctx.decode(b)
    out["after_exit"] = ctx.logits(-1)
    # a staged decode run to the end equals llama_decode
    b.set([310, 311], len(PROMPT) + 3, output_last_only=False)
    ctx.stage_begin(b)
    ctx.stage_run(1)
    ctx.stage_run(N_LAYER)
    out["staged_full"] = all_logits(ctx, 2)
    ctx.close()
    ref = ctx_of(model)
    b.set(PROMPT + nxt, 0, output_last_only=False)
    ref.decode(b)
    b.set([309, 310, 311], len(PROMPT) + 2, output_last_only=False)
    ref.decode(b)
    # a full-depth history: compared across extra buffers on/off like the rest
    out["full_depth"] = all_logits(ref, 3)
    ref.close()
    model.close()
    return out


def real_kernels(directory: str, quant: str) -> None:
    path = make_model(Path(directory), quant)
    os.environ["RK_EXTRA"] = "1"
    fast = run_pair(path)
    os.environ["RK_EXTRA"] = "0"
    plain = run_pair(path)
    for key in fast:
        close(fast[key], plain[key], f"{quant}: {key}, extra buffers on vs off")
    print("ok")


def prefetch_changes_nothing(directory: str, quant: str) -> None:
    """Patch 0013: every array of run_pair (prompt batch, staged decode, exit, one-token
    decodes) is the same bit for bit with the weights asked for ahead (the distance a machine
    may choose) and with that switched off in the loaded library: a prefetch only moves
    data."""
    from specee_cpp.bindings import kernel_switch, set_kernel_switch
    from specee_cpp.config import READ_AHEAD_BYTES

    path = make_model(Path(directory), quant)
    before = kernel_switch("READ_AHEAD")
    assert before is not None, "no weight read-ahead switch in this library"
    set_kernel_switch("READ_AHEAD", READ_AHEAD_BYTES)
    try:
        on = run_pair(path)
        set_kernel_switch("READ_AHEAD", 0)
        off = run_pair(path)
    finally:
        set_kernel_switch("READ_AHEAD", before)
    for key in on:
        assert np.array_equal(on[key], off[key]), f"{quant}: {key} differs with prefetch off"
    print("ok")


BATCH_ROWS = (2, 3, 4, 5, 9, 16)
MAX_BATCH_ROWS = 70


def system_info() -> None:
    """The loaded library's ISA flags (which CPU backend a check ran on)."""
    from specee_cpp.bindings import library_info

    print(library_info()["system_info"])


def unpatched_one_row_logits(reference: str, model: Path, n_ctx: int, prompt: list[int],
                             nxt: list[int], n_vocab: int, directory: Path) -> np.ndarray:
    """The logits of ``nxt`` decoded one at a time after ``prompt`` by ``reference``, the
    program scripts/one_row_logits.c built from unpatched llama.cpp sources."""
    out = directory / "unpatched-logits.f32"
    r = subprocess.run([reference, str(model), str(n_ctx), ",".join(map(str, prompt)),
                        ",".join(map(str, nxt)), str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"{reference} failed ({r.returncode}): {r.stderr[-2000:]}")
    return np.fromfile(out, dtype=np.float32).reshape(len(nxt), n_vocab)


def small_batch_rows(directory: str, quant: str, rows: str = "", part: str = "all",
                     shape: str = "narrow", context: str = "8", reference: str = "") -> None:
    """Each row of a batch of tokens (a verification) against the same token decoded alone:
    prints the largest |difference| of each batch size's rows (rows: comma-separated sizes,
    "a-b" a range, up to MAX_BATCH_ROWS, default BATCH_ROWS; part "tail": only the rows
    after the last whole group of 4, those a 4-row gemm leaves; shape: the model's, SHAPES;
    context: tokens cached before the batch, from 512 on a one-token decode's attention is
    where upstream splits the keys over the threads).
    The patched kernels make them equal bit for bit up to the switches' limits (64 rows by
    default): on AMX row by row with the one-row kernel (patch 0009) or several rows at once
    (0010: Q4_K/Q6_K, groups of up to 8 rows); on x86's repacked Q4_K several rows at once
    (0015; with AVX2 alone 32 rows a pass; with AVX-512 VNNI two strips of columns at
    once), in groups of up to 4 (9 = 4 + 3 + 2) where the limit leaves the rest to the
    gemm; on x86's Q6_K (0016) each weight row against up to 16 rows at once
    (instead of a dot per pair or, from 8 rows, llama.cpp's tiled matmul).
    With ``reference`` (the path of scripts/one_row_logits.c built from unpatched sources),
    the one-at-a-time decodes themselves are first held to that build's, bit for bit: the
    patched library replaces some one-row kernels too (Q6_K's on AVX-512), and a bug shared
    by its one-row and its batched paths would otherwise pass."""
    sizes = []
    for part_ in (rows.split(",") if rows else [str(n) for n in BATCH_ROWS]):
        lo, _, hi = part_.partition("-")
        sizes += list(range(int(lo), int(hi or lo) + 1))
    path = make_model(Path(directory), quant, shape)
    model = Model(path)
    b = Batch(MAX_BATCH_ROWS)
    # 304-319 and again: a token may repeat at another position
    nxt = [304 + i % 16 for i in range(max(sizes))]
    prompt = (PROMPT * (int(context) // len(PROMPT) + 1))[:int(context)]
    n_ctx = len(prompt) + MAX_BATCH_ROWS + 8

    def read_prompt(ctx: Context, step: int = 16) -> None:
        # in batches of 16 in both contexts, by default: the same kernels fill the same cache
        for i in range(0, len(prompt), step):
            b.set(prompt[i:i + step], i)
            ctx.decode(b)

    alone = Context(model, n_ctx=n_ctx, n_batch=16, n_threads=2)
    # against the unpatched build, whose batches round differently, both read one at a time
    read_prompt(alone, 1 if reference else 16)
    singles = []
    for i, t in enumerate(nxt):
        b.set([t], len(prompt) + i)
        alone.decode(b)
        singles.append(alone.logits(-1))
    if reference:
        theirs = unpatched_one_row_logits(reference, path, n_ctx, prompt, nxt,
                                          len(singles[0]), Path(directory))
        ours = np.stack(singles)
        differ = np.flatnonzero(np.any(ours != theirs, axis=1))
        if len(differ):
            k = int(differ[0])
            raise AssertionError(
                f"{quant}: one-row decode {k} differs from the unpatched build's: max |diff| "
                f"{float(np.max(np.abs(ours[k] - theirs[k]))):.4g}")
    diffs = []
    batched = Context(model, n_ctx=n_ctx, n_batch=MAX_BATCH_ROWS, n_threads=2)
    read_prompt(batched)
    for n in sizes:
        b.set(nxt[:n], len(prompt), output_last_only=False)   # one decode of n rows
        batched.decode(b)
        got, alone_rows = all_logits(batched, n), np.stack(singles[:n])
        batched.seq_rm(len(prompt))   # the next size sees the same cache
        if n <= 64:
            # above, a prompt's batch: upstream's kernels, whose rounding moves this random
            # model's logits by up to ~20% of their spread
            close(got, alone_rows, f"{quant}: batch of {n} vs one at a time")
        first = n - n % 4 if part == "tail" else 0
        diffs.append(float(np.max(np.abs(got[first:] - alone_rows[first:]))))
    batched.close()
    alone.close()
    model.close()
    print(" ".join(f"{d:.3g}" for d in diffs))


def attention_rows(directory: str, quant: str, context: str = "600") -> None:
    """Patch 0014's attention against upstream's and against itself. One-row decodes after
    ``context`` tokens: close to upstream's attention (ATTN_ROWS 0: the key split over the
    threads from 512 keys, f16 sums), and bit for bit the same on 1 and 3 threads (which
    split the heads differently). Then, with every row switch taking every batch, batches
    of up to 200 rows equal the same tokens decoded one at a time, bit for bit. Prints the
    largest |difference| of those batches' rows, one per size."""
    from specee_cpp.bindings import KERNEL_SWITCHES, kernel_switch, set_kernel_switch

    path = make_model(Path(directory), quant, "wide")
    model = Model(path)
    prompt = (PROMPT * (int(context) // len(PROMPT) + 1))[:int(context)]
    nxt = [304 + i % 16 for i in range(200)]
    n_ctx = len(prompt) + len(nxt) + 8
    b = Batch(len(nxt))

    def after_prompt(threads: int) -> Context:
        ctx = Context(model, n_ctx=n_ctx, n_batch=len(nxt), n_threads=threads)
        for i in range(0, len(prompt), 16):
            b.set(prompt[i:i + 16], i)
            ctx.decode(b)
        return ctx

    def one_at_a_time(threads: int, attn_rows: int | None = None) -> np.ndarray:
        before = kernel_switch("ATTN_ROWS")
        if attn_rows is not None:
            set_kernel_switch("ATTN_ROWS", attn_rows)
        ctx = after_prompt(threads)
        out = []
        for i, t in enumerate(nxt):
            b.set([t], len(prompt) + i)
            ctx.decode(b)
            out.append(ctx.logits(-1))
        ctx.close()
        set_kernel_switch("ATTN_ROWS", before)
        return np.stack(out)

    ours = one_at_a_time(2)
    theirs = one_at_a_time(2, 0)
    # this random model moves its logits far on any change of rounding (a logit by up to a
    # third of their spread between upstream's own attention paths, a few in a hundred
    # tokens to another argmax), so the check is on the mean: a wrong scale, mask or sum
    # is off by several times more
    mean, spread = float(np.mean(np.abs(ours - theirs))), float(np.std(theirs))
    agree = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    if os.environ.get("RK_VERBOSE"):
        print(f"attention rows vs upstream's: {mean / spread:.4f}, {agree:.2f}", file=sys.stderr)
    if not np.all(np.isfinite(ours)) or mean > ATTN_MEAN_TOL * spread or agree < ATTN_AGREE:
        raise AssertionError(f"{quant}: attention rows vs upstream's: mean |diff| {mean:.4g} "
                             f"(std {spread:.4g}), argmax agreement {agree:.2f}")
    if not np.array_equal(ours, one_at_a_time(3)):
        raise AssertionError(f"{quant}: one-row decodes differ between 2 and 3 threads")
    row_switches = [n for n in KERNEL_SWITCHES if n.endswith("_ROWS")]
    for n in row_switches:
        set_kernel_switch(n, 1 << 30)
    ctx = after_prompt(2)
    diffs = []
    for n in (65, 128, 200):
        b.set(nxt[:n], len(prompt), output_last_only=False)
        ctx.decode(b)
        diffs.append(float(np.max(np.abs(all_logits(ctx, n) - ours[:n]))))
        ctx.seq_rm(len(prompt))
    ctx.close()
    model.close()
    print(" ".join(f"{d:.3g}" for d in diffs))


@functools.lru_cache(maxsize=1)
def _ggml():
    """ggml's graph API from the loaded libraries, through ctypes: (base, cpu)."""
    import ctypes as C

    from specee_cpp.bindings import library_file

    class InitParams(C.Structure):   # ggml.h's struct ggml_init_params
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]

    base, cpu = C.CDLL(str(library_file("ggml-base"))), C.CDLL(str(library_file("ggml-cpu")))
    for name, res, args in [
            ("ggml_init", C.c_void_p, [InitParams]), ("ggml_free", None, [C.c_void_p]),
            ("ggml_new_tensor_4d", C.c_void_p, [C.c_void_p, C.c_int] + [C.c_int64] * 4),
            ("ggml_flash_attn_ext", C.c_void_p, [C.c_void_p] * 5 + [C.c_float] * 3),
            ("ggml_flash_attn_ext_add_sinks", None, [C.c_void_p, C.c_void_p]),
            ("ggml_new_graph", C.c_void_p, [C.c_void_p]),
            ("ggml_build_forward_expand", None, [C.c_void_p, C.c_void_p]),
            ("ggml_get_data", C.c_void_p, [C.c_void_p])]:
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.restype = C.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [C.c_void_p, C.c_void_p, C.c_int]
    base.InitParams = InitParams
    return base, cpu


def flash_attn(q, k, v, mask, scale, max_bias, softcap, sinks, threads):
    """ggml_flash_attn_ext on the CPU backend: q (H, N, D) f32, k/v (Hkv, n_kv, D) f16, mask
    (N, n_kv) f16, sinks (H,) f32 or None; returns (N, H, DV) f32."""
    import ctypes as C

    base, cpu = _ggml()
    ctx = base.ggml_init(base.InitParams(64 << 20, None, False))
    try:
        def tensor(a, gtype):
            ne = list(reversed(a.shape)) + [1] * (4 - a.ndim)
            t = base.ggml_new_tensor_4d(ctx, gtype, *ne)
            a = np.ascontiguousarray(a)     # held while copied
            C.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
            return t
        f32, f16 = 0, 1
        out = base.ggml_flash_attn_ext(ctx, tensor(q, f32), tensor(k, f16), tensor(v, f16),
                                       tensor(mask, f16), scale, max_bias, softcap)
        if sinks is not None:
            base.ggml_flash_attn_ext_add_sinks(out, tensor(sinks, f32))
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        if cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
            raise AssertionError("ggml_graph_compute failed")
        n, h, dv = q.shape[1], q.shape[0], v.shape[2]
        res = np.empty((n, h, dv), np.float32)
        C.memmove(res.ctypes.data, base.ggml_get_data(out), res.nbytes)
        return res
    finally:
        base.ggml_free(ctx)


def attention_reference(q, k, v, mask, scale, max_bias, softcap, sinks):
    """The same attention in float64 (ggml's definition: softcap, ALiBi slopes, sinks)."""
    h, n, _ = q.shape
    hkv = k.shape[0]
    log2 = 1 << int(np.floor(np.log2(h)))
    m0, m1 = 2.0 ** (-max_bias / log2), 2.0 ** (-(max_bias / 2.0) / log2)
    out = np.zeros((n, h, v.shape[2]))
    for hd in range(h):
        slope = 1.0 if max_bias <= 0 else (m0 ** (hd + 1) if hd < log2
                                           else m1 ** (2 * (hd - log2) + 1))
        kk = k[hd // (h // hkv)].astype(np.float64)
        vv = v[hd // (h // hkv)].astype(np.float64)
        s = q[hd].astype(np.float64) @ kk.T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = s + slope * mask.astype(np.float64)
        top = s.max(axis=1, keepdims=True)
        if sinks is not None:
            top = np.maximum(top, sinks[hd])
        w = np.exp(s - top)
        den = w.sum(axis=1) + (np.exp(sinks[hd] - top[:, 0]) if sinks is not None else 0)
        out[:, hd] = (w @ vv) / den[:, None]
    return out


# (D, heads, KV heads, rows, cells, first cell of the sequence, softcap, ALiBi max_bias,
# sinks): GQA over a sequence that starts mid-cache; no GQA, a head size that is no multiple
# of a SIMD register, softcap and ALiBi; sinks
ATTN_CASES = [(128, 6, 2, 37, 300, 50, 0.0, 0.0, False),
              (80, 4, 4, 5, 100, 0, 20.0, 8.0, False),
              (64, 8, 2, 19, 140, 3, 0.0, 0.0, True)]


def attention_op(seed: str = "0") -> None:
    """Patch 0014's attention kernel as ggml computes it, against float64 on the same inputs,
    and against itself: each row of a batch equals that row computed alone, on 1 and 3
    threads, and wherever its sequence's cells start. Prints the largest error of each case
    relative to the largest |output|."""
    from specee_cpp.bindings import kernel_switch, set_kernel_switch

    rng = np.random.default_rng(int(seed))
    before = kernel_switch("ATTN_ROWS")
    set_kernel_switch("ATTN_ROWS", 1 << 30)
    errs = []
    try:
        for d, h, hkv, n, cells, lo, softcap, max_bias, with_sinks in ATTN_CASES:
            q = rng.normal(0, 1, (h, n, d)).astype(np.float32)
            k = rng.normal(0, 1, (hkv, cells, d)).astype(np.float16)
            v = rng.normal(0, 1, (hkv, cells, d)).astype(np.float16)
            sinks = rng.normal(0, 1, h).astype(np.float32) if with_sinks else None
            ctx0 = cells - lo - n   # cells of the sequence before the batch
            mask = np.full((n, cells), -np.inf, np.float32)
            for i in range(n):
                mask[i, lo:lo + ctx0 + i + 1] = (-rng.uniform(0, 2, ctx0 + i + 1)
                                                  if max_bias else 0.0)
            mask = mask.astype(np.float16)
            scale = 1.0 / np.sqrt(d)
            args = (scale, max_bias, softcap, sinks)
            got = flash_attn(q, k, v, mask, *args, threads=2)
            want = attention_reference(q, k, v, mask, *args)
            errs.append(float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
            if not np.array_equal(got, flash_attn(q, k, v, mask, *args, threads=1)) or \
                    not np.array_equal(got, flash_attn(q, k, v, mask, *args, threads=3)):
                raise AssertionError(f"case D={d}: rows differ with the thread count")
            for i in range(n):
                alone = flash_attn(q[:, i:i + 1], k, v, mask[i:i + 1], *args, threads=2)
                if not np.array_equal(alone[0], got[i]):
                    raise AssertionError(f"case D={d}: row {i} of {n} differs from it alone")
            # the sequence 7 cells further on, the cells before it another sequence's
            pad = 7
            k2 = np.concatenate([rng.normal(0, 1, (hkv, pad, d)).astype(np.float16), k], 1)
            v2 = np.concatenate([rng.normal(0, 1, (hkv, pad, d)).astype(np.float16), v], 1)
            mask2 = np.concatenate([np.full((n, pad), -np.inf, np.float16), mask], 1)
            if not np.array_equal(got, flash_attn(q, k2, v2, mask2, *args, threads=2)):
                raise AssertionError(f"case D={d}: rows differ with where the cells start")
    finally:
        set_kernel_switch("ATTN_ROWS", before)
    print(" ".join(f"{e:.2g}" for e in errs))


# call mix of the fuzz: stages begun often enough that runs, probes and exits succeed too
OPS = ["decode", "begin", "run", "run_cand", "head", "exit", "abort", "capture", "hidden",
       "clear", "seq_rm", "begin2"]
WEIGHTS = [0.1, 0.2, 0.1, 0.15, 0.07, 0.1, 0.05, 0.04, 0.05, 0.03, 0.05, 0.06]


def fuzz_staged(directory: str, quant: str, seed: str = "0", n: str = "300") -> None:
    """Random staged-API calls in random order: only return codes / exceptions allowed."""
    rng = np.random.default_rng(int(seed))
    model = Model(make_model(Path(directory), quant))
    ctx = Context(model, n_ctx=64, n_batch=8, n_threads=2, n_seq_max=2, kv_unified=False)
    b = Batch(16)
    pos = 0
    counts: dict[str, int] = {}
    for _ in range(int(n)):
        op = rng.choice(OPS, p=WEIGHTS)
        try:
            if op == "decode":
                k = int(rng.integers(1, 4))
                b.set([int(t) for t in rng.integers(0, N_VOCAB, k)], pos)
                ctx.decode(b)
                pos += k
            elif op == "begin":
                k = int(rng.integers(1, 12))  # past n_batch 8 too
                b.set([int(t) for t in rng.integers(0, N_VOCAB, min(k, 16))],
                      int(rng.choice([pos, pos + 3, max(pos - 1, 0)], p=[0.8, 0.1, 0.1])),
                      output_last_only=bool(rng.integers(0, 2)))
                ctx.stage_begin(b)
                pos += k
            elif op == "begin2":  # two sequences, unequal counts, non-unified cache
                raw = b.raw
                raw.n_tokens = 3
                for i, (s, p) in enumerate([(0, pos), (1, 0), (0, pos + 1)]):
                    raw.token[i], raw.pos[i], raw.n_seq_id[i] = 5 + i, p, 1
                    raw.seq_id[i][0], raw.logits[i] = s, 1
                ctx.stage_begin(b)
            elif op in ("run", "run_cand"):
                valid = rng.random() < 0.8  # mostly well-formed, so that stages advance
                cur = ctx.stage_layer
                il = cur + 1 if valid and cur >= 0 else int(rng.integers(-1, N_LAYER + 2))
                cand = None
                if op == "run_cand":
                    n_tok = max(ctx.stage_n_tokens, 1)
                    k = int(rng.choice([1, 4, 65], p=[0.45, 0.45, 0.1]))
                    lo, hi = (0, N_VOCAB) if valid else (-2, N_VOCAB + 5)
                    cand = rng.integers(lo, hi, (n_tok, k)).astype(np.int32)
                ctx.stage_run(il, cand)
            elif op == "head":
                ctx.stage_head()
            elif op == "exit":
                ctx.stage_exit(bool(rng.integers(0, 2)))
            elif op == "abort":
                ctx.stage_abort()
            elif op == "capture":
                if rng.random() < 0.3:
                    ctx.set_layer_inp(int(rng.integers(-1, N_LAYER + 1)), True)
                else:
                    for il in range(N_LAYER):
                        ctx.set_layer_inp(il, False)
            elif op == "hidden":
                ctx.stage_hidden()
            elif op == "clear":
                ctx.stage_abort()
                ctx.clear()
                pos = 0
            elif op == "seq_rm":
                ctx.stage_abort()
                ctx.seq_rm(int(rng.integers(0, 8)))
                pos = min(pos, 8)
            counts[f"{op}:ok"] = counts.get(f"{op}:ok", 0) + 1
        except SpeceeError:
            counts[f"{op}:error"] = counts.get(f"{op}:error", 0) + 1
        # the next well-formed position of sequence 0, whatever the call did to the cache
        pos = int(ll.llama_memory_seq_pos_max(ctx.mem, 0)) + 1
        if pos > 40:
            ctx.stage_abort()
            ctx.clear()
            pos = 0
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())))


def capture_then_stage(directory: str, quant: str) -> None:
    model = Model(make_model(Path(directory), quant))
    ctx = ctx_of(model)
    b = Batch(16)
    b.set(PROMPT, 0)
    ctx.set_layer_inp(1, True)
    ctx.decode(b)
    try:
        ctx.stage_begin(b)
    except SpeceeError as e:
        print(f"refused: {e}")
    else:
        raise AssertionError("stage_begin accepted a context with layer-input capture on")
    ctx.set_layer_inp(1, False)
    b.set([307], len(PROMPT))
    ctx.stage_begin(b)
    try:
        ctx.set_layer_inp(2, True)
    except SpeceeError:
        pass
    else:
        raise AssertionError("layer-input capture was enabled inside an open stage")
    ctx.stage_run(N_LAYER)
    print("ok")


def multi_sequence(directory: str, quant: str) -> None:
    """Several sequences in one staged batch: refused where the cache would split or reorder
    them (non-unified), correct where it keeps batch order (unified)."""
    model = Model(make_model(Path(directory), quant))
    rows = [(0, 0, 300), (1, 0, 301), (1, 1, 302), (0, 1, 303), (0, 2, 304)]

    def batch() -> Batch:
        b = Batch(16)
        raw = b.raw
        raw.n_tokens = len(rows)
        for i, (s, p, t) in enumerate(rows):
            raw.token[i], raw.pos[i], raw.n_seq_id[i] = t, p, 1
            raw.seq_id[i][0], raw.logits[i] = s, 1
        return b

    split = Context(model, n_ctx=64, n_batch=16, n_threads=2, n_seq_max=2, kv_unified=False)
    try:
        split.stage_begin(batch())
    except SpeceeError:
        pass
    else:
        raise AssertionError("a batch the non-unified cache reorders was staged")
    # the cache is unchanged by the refusal: a plain decode of the same batch still fits
    split.decode(batch())
    unified = Context(model, n_ctx=64, n_batch=16, n_threads=2, n_seq_max=2, kv_unified=True)
    unified.stage_begin(batch())
    unified.stage_run(N_LAYER)
    staged = all_logits(unified, len(rows))
    plain = Context(model, n_ctx=64, n_batch=16, n_threads=2, n_seq_max=2, kv_unified=True)
    plain.decode(batch())
    close(staged, all_logits(plain, len(rows)), "unified multi-sequence stage vs decode")
    print("ok")


if __name__ == "__main__":
    getattr(sys.modules[__name__], sys.argv[1])(*sys.argv[2:])

"""Tiny quantized models on llama.cpp's real CPU kernels (repacked weights and head, AMX where
the CPU has it), each check in a child process (see kernel_checks.py): plain decode, staged
decode, candidate probes on a repacked head, exit with filled KV, a fuzz of the staged API,
layer capture + stage, several sequences. Before patch 0004 the probes, the capture and the
sequence cases ended the process in GGML_ASSERT."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_path import load_script

from specee_cpp.bindings import library_file

HERE = Path(__file__).parent
QUANTS = ["Q4_0", "Q4_K", "Q6_K", "IQ4_NL"]


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def child(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """kernel_checks.py ARGS in a child process (``env``: variables set for it), its
    stdout; a crash fails the test with its signal."""
    base = {k: v for k, v in os.environ.items() if k != "RK_EXTRA"}
    r = subprocess.run([sys.executable, str(HERE / "kernel_checks.py"), *args], cwd=HERE,
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(base, **(env or {})))
    if r.returncode < 0:
        pytest.fail(f"{args[0]} died with {signal.Signals(-r.returncode).name}:\n"
                    f"{r.stderr[-3000:]}")
    assert r.returncode == 0, f"{args[0]} failed:\n{r.stderr[-3000:]}"
    return r.stdout.strip()


@pytest.mark.parametrize("quant", QUANTS)
def test_extra_buffers_match_plain_buffers(kdir, quant):
    assert child("real_kernels", str(kdir), quant) == "ok"


@pytest.mark.parametrize("quant", ["Q4_0", "IQ4_NL"])
def test_staged_api_fuzz_returns_errors_only(kdir, quant):
    out = child("fuzz_staged", str(kdir), quant, "3", "400")
    counts = dict(kv.split("=") for kv in out.split())
    # the fuzz reached both outcomes of the calls that matter
    for op in ("begin", "run_cand", "run"):
        assert int(counts.get(f"{op}:ok", 0)) > 0 and int(counts.get(f"{op}:error", 0)) > 0, out
    assert int(counts.get("exit:ok", 0)) + int(counts.get("head:ok", 0)) > 0, out
    assert int(counts.get("begin2:error", 0)) > 0, out


def test_layer_capture_and_stage_are_exclusive(kdir):
    assert child("capture_then_stage", str(kdir), "Q4_0").startswith("refused")


def test_several_sequences(kdir):
    assert child("multi_sequence", str(kdir), "Q4_0") == "ok"


def system_repacks_x86() -> bool:
    from specee_cpp.bindings import library_info

    info = library_info()["system_info"]
    return "REPACK = 1" in info and "AVX2 = 1" in info


# Every batch a verification takes, 1 to 64 rows (drafts from the context reach 64), equals
# the same tokens decoded one at a time, bit for bit, with the library's defaults: the row
# kernels take those batches, and attention reads each row's keys as one row does. Above 64
# rows (a prompt's batch) upstream's kernels round differently. The wide model's rows span 5-14
# K-quant super-blocks, so a wrong step from one block of a row to the next shows in every
# projection (the Q6_K rows kernel planted to read the scale of a row's third block from its
# second: "batch of 2 vs one at a time: max |diff| 45" on the wide model, while the narrow
# one, rows of 1-2 blocks, passes); 600 tokens of context are past the 512 keys where
# upstream splits a one-token decode's attention over the threads (ATTN_ROWS 0: rows differ).
EXACT = " ".join(["0"] * 64)


def exact_then_upstream(out: str) -> None:
    diffs = out.split()
    assert " ".join(diffs[:64]) == EXACT, out
    assert len(diffs) == 70 and all(float(d) > 0 for d in diffs[64:]), out


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
@pytest.mark.parametrize("context,one_row", [("8", "0"), ("600", "0"), ("8", "1")])
def test_verification_batches_on_repacked_q4_k_equal_one_row_decodes(kdir, monkeypatch,
                                                                      context, one_row):
    # patch 0015's rows kernel of the build's ISA (AVX2: 32 rows a pass, so 33 = 32 + 1;
    # AVX-512 VNNI: two strips of columns at once). With AMX on, the
    # AMX buffer takes these weights: switch it off so the repack runs. ONE_ROW 1 (where
    # timed faster) puts the one-token decodes on the rows kernel too: they still equal
    # the batches' rows, which with ONE_ROW 0 equal upstream's one-row kernel's
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    monkeypatch.setenv("SPECEE_CPP_ONE_ROW", one_row)
    exact_then_upstream(child("small_batch_rows", str(kdir), "Q4_K", "1-70", "all", "wide",
                              context))


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 AVX2 kernels")
@pytest.mark.parametrize("context", ["8", "600"])
def test_verification_batches_on_q6_k_equal_one_row_decodes(kdir, monkeypatch, context):
    # patch 0016 (each weight row against up to 16 rows at once, a batch in groups of 16;
    # 512-bit steps and constant row counts on AVX-512 builds)
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    exact_then_upstream(child("small_batch_rows", str(kdir), "Q6_K", "1-70", "all", "wide",
                              context))


@pytest.mark.parametrize("quant", ["Q4_0", "IQ4_NL", "Q8_0"])
def test_verification_batches_of_other_types_equal_one_row_decodes(kdir, monkeypatch, quant):
    # the types users quantize whole models to besides the K-quants (repacked Q4_0/IQ4_NL,
    # Q8_0 through llama.cpp's own kernels): every verification size, past the key split
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    assert child("small_batch_rows", str(kdir), quant, "1-64", "all", "wide", "600") == EXACT


@pytest.mark.parametrize("quant", ["Q4_K", "Q6_K", "Q4_0", "IQ4_NL", "Q8_0"])
def test_one_row_and_batched_decodes_equal_an_unpatched_build_s_one_row_decodes(kdir, quant,
                                                                                  monkeypatch):
    # the unpatched reference is scripts/one_row_logits.c, built with the peers from the
    # same sources (no kernel of ours); both libraries keep their default buffers (AMX where
    # the CPU has it, else the repack), as users run them. Our attention is upstream's here
    # (ATTN_ROWS 0; ours is held to it by the next test): 8 tokens of context, before upstream
    # splits a one-token decode's keys over the threads (from 512), and batches below the
    # 64 rows from which it tiles them, each of whose rows attends as one row does
    from specee_cpp.bench.peers import tools_dir

    build_peers = load_script("build_peers")
    reference = tools_dir() / build_peers.exe(build_peers.REFERENCE)
    assert reference.is_file(), f"{reference} missing: set-up builds it with the peers"
    monkeypatch.setenv("SPECEE_CPP_ATTN_ROWS", "0")
    assert child("small_batch_rows", str(kdir), quant, "1-63", "all", "wide", "8",
                 str(reference)) == " ".join(["0"] * 63)


def test_attention_kernel_equals_float64_and_each_row_alone():
    # patch 0014's attention on ggml's op itself (kernel_checks.ATTN_CASES: GQA, a sequence
    # that starts mid-cache, a head size of no whole SIMD registers, softcap, ALiBi, sinks): within
    # 1e-5 of the largest output against float64 (upstream's one-pass kernel, which sums in
    # f16, is ~4e-3 off here), and every row bit for bit the same alone, on 1 and 3 threads
    # and 7 cells further on in the cache
    errs = child("attention_op", "0").split()
    assert len(errs) == 3 and all(float(e) < 1e-5 for e in errs), errs


@pytest.mark.parametrize("quant", ["Q4_K", "Q8_0"])
def test_attention_rows_equal_upstream_s_closely_and_themselves_exactly(kdir, monkeypatch,
                                                                        quant):
    # patch 0014: one-row decodes near upstream's attention (past its key split at 512
    # keys), the same on another thread count; and with every row switch at every batch
    # (a prompt read by the row kernels), batches of 65-200 rows equal one-row decodes
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    assert child("attention_rows", str(kdir), quant, "600") == "0 0 0"


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
def test_a_lower_row_limit_leaves_the_rest_to_the_gemm(kdir, monkeypatch):
    # REPACK_ROWS 3: batches of 4 and more take upstream's gemm and the rows it leaves go
    # together; those rows attend to the gemm's rows, so they differ from one-at-a-time
    # decodes as upstream's do, but by exactly as much as upstream's (its gemv row by row,
    # REPACK_ROWS 0)
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    monkeypatch.setenv("SPECEE_CPP_REPACK_ROWS", "3")
    together = child("small_batch_rows", str(kdir), "Q4_K", "2,3,6,7,11", "tail")
    monkeypatch.setenv("SPECEE_CPP_REPACK_ROWS", "0")
    upstream = child("small_batch_rows", str(kdir), "Q4_K", "2,3,6,7,11", "tail")
    assert together == upstream and together.startswith("0 0 "), (together, upstream)


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
@pytest.mark.parametrize("quant", ["IQ4_NL", "Q4_0"])
def test_small_batches_on_repacked_iq4_nl_and_q4_0_equal_one_row_decodes(kdir, monkeypatch,
                                                                         quant):
    # patch 0015 takes 2-3 rows against repacked IQ4_NL / Q4_0 weights (a draft's catch-up)
    # together, one pass over the weights: each row must equal that token decoded alone.
    # Batches of 4 and more take upstream's gemm, and the 2-3 rows it leaves go together:
    # they differ from one-at-a-time decodes by exactly as much as upstream's rows do
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    monkeypatch.delenv("SPECEE_CPP_REPACK_ROWS", raising=False)
    assert child("small_batch_rows", str(kdir), quant, "2,3") == "0 0"
    together = child("small_batch_rows", str(kdir), quant, "6,7,11", "tail")
    monkeypatch.setenv("SPECEE_CPP_REPACK_ROWS", "0")
    upstream = child("small_batch_rows", str(kdir), quant, "6,7,11", "tail")
    assert together == upstream, (together, upstream)


def q8_k_inputs():
    """Rows (a numpy array) of 64 blocks with what the reference's scalar loop decides on:
    ties of |x| with both signs (which one is the block's max), rounding ties, all-zero
    blocks (bsums left as they were), NaNs with payloads (skipped by amax), infinities, tiny
    and huge values, and blocks whose largest |x| is under ~4e-37, where -127/max overflows
    to infinity and the products' ints (-2^22) reach the int8 store, which truncates them
    to 0."""
    import numpy as np

    rng = np.random.default_rng(7)
    rows = []
    for kind in range(11):
        for _ in range(20):
            x = rng.uniform(-1, 1, 256 * 64).astype(np.float32)
            if kind == 1:
                x *= np.float32(1e-30)
            elif kind == 2:
                x *= np.float32(1e6)
            elif kind == 3:   # the block's largest |x| several times, with either sign
                x *= np.float32(0.5)
                tie = rng.random(x.size) < 0.05
                x[tie] = np.where(rng.random(tie.sum()) < 0.5, -0.75, 0.75)
            elif kind == 4:
                x[rng.random(x.size) < 0.3] = 0
            elif kind == 5:
                x.reshape(64, 256)[::3] = np.where(np.arange(256) % 2, 0.0, -0.0)
            elif kind == 6:
                bits = (np.uint32(0x7F800001) | (rng.integers(0, 2**32, x.size, dtype=np.uint32)
                                                 & np.uint32(0x807FFFFF)))
                nan = rng.random(x.size) < 0.02
                x[nan] = bits[nan].view(np.float32)
            elif kind == 7:
                inf = rng.random(x.size) < 0.01
                x[inf] = np.where(rng.random(inf.sum()) < 0.5, np.inf, -np.inf)
            elif kind == 8:
                x = (np.trunc(x * 20) / 8).astype(np.float32)
            elif kind == 9:
                x *= np.float32(1e-38)
            rows.append(x)
    return np.stack(rows)


def test_q8_k_activations_equal_the_reference_bit_for_bit():
    """Patch 0012: x86's quantize_row_q8_K (AVX2; every K-quant matmul's activations) writes
    the same bytes as ggml's scalar quantize_row_q8_K_ref, d, quants and bsums, on inputs
    where the reference's order of decisions matters (an FMA-contracted product or a
    saturating int8 store differs here: both checked against builds that had them)."""
    import ctypes

    import numpy as np

    base, cpu = library_file("ggml-base"), library_file("ggml-cpu")
    if base is None or cpu is None:
        pytest.skip("no ggml-base/ggml-cpu library in the installed package")
    # already loaded by llama_cpp: the same handles
    ref, fast = ctypes.CDLL(str(base)).quantize_row_q8_K_ref, ctypes.CDLL(str(cpu)).quantize_row_q8_K
    for f in (ref, fast):
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        f.restype = None
    block = 4 + 256 + 2 * 16
    for x in q8_k_inputs():
        want = np.full(block * 64, 0x5A, np.uint8)
        got = want.copy()
        ref(x.ctypes.data, want.ctypes.data, x.size)
        fast(x.ctypes.data, got.ctypes.data, x.size)
        bad = np.flatnonzero((want != got).reshape(64, block).any(axis=1))
        assert bad.size == 0, f"blocks {bad[:5].tolist()} differ from quantize_row_q8_K_ref"


def test_q6_k_dot_equals_the_dequantized_dot():
    """Patch 0016: on AVX-512 builds the Q6_K dot (ggml's vec_dot for Q6_K, every plain
    token's head) runs in 512-bit steps that pair the AVX2 kernel's operands two by two.
    Checked here against the dot of both operands dequantized by ggml (float64 sums): a
    quant, scale or activation put in the wrong half is off by ~1/sqrt(n) of the sum of
    |products|, the kernel's own rounding by ~1e-7 of it. That every batch of 2-16 rows
    equals this dot bit for bit is the model test above; that this dot equals the AVX2
    kernel's bit for bit was checked when the patch was made (docs/kernels.md, patch 0016)."""
    import ctypes

    import numpy as np

    base, cpu = library_file("ggml-base"), library_file("ggml-cpu")
    if base is None or cpu is None:
        pytest.skip("no ggml-base/ggml-cpu library in the installed package")
    lb, lc = ctypes.CDLL(str(base)), ctypes.CDLL(str(cpu))
    q6_k, q8_k, qk = 14, 15, 256
    to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    from_float_t = to_float_t
    vec_dot_t = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_int)

    class Traits(ctypes.Structure):   # ggml.h's struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", to_float_t),
                    ("from_float_ref", from_float_t)]

    class CpuTraits(ctypes.Structure):   # ggml-cpu.h's struct ggml_type_traits_cpu
        _fields_ = [("from_float", from_float_t), ("vec_dot", vec_dot_t),
                    ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]

    lb.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lc.ggml_get_type_traits_cpu.restype = ctypes.POINTER(CpuTraits)
    lc.ggml_cpu_init()
    t6, t8 = lb.ggml_get_type_traits(q6_k).contents, lb.ggml_get_type_traits(q8_k).contents
    assert t8.type_size == 4 + qk + 2 * qk // 16
    cpu6 = lc.ggml_get_type_traits_cpu(q6_k).contents
    assert cpu6.vec_dot_type == q8_k
    rng = np.random.default_rng(17)
    n = 6 * qk
    for case in range(24):
        w = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
        a = rng.standard_normal(n).astype(np.float32)
        if case % 3 == 1:   # a few large activations: full-range quants in every block
            a[rng.integers(0, n, 16)] *= np.float32(40)
        if case % 3 == 2:   # weights of one sign in some blocks, large ones in others
            w[:qk] = np.abs(w[:qk])
            w[2 * qk:3 * qk] *= np.float32(100)
        wq = np.zeros(n // qk * t6.type_size, np.uint8)
        aq = np.zeros(n // qk * t8.type_size, np.uint8)
        t6.from_float_ref(w.ctypes.data, wq.ctypes.data, n)
        lc.quantize_row_q8_K(ctypes.c_void_p(a.ctypes.data), ctypes.c_void_p(aq.ctypes.data),
                             ctypes.c_int64(n))
        wd = np.zeros(n, np.float32)
        t6.to_float(wq.ctypes.data, wd.ctypes.data, n)
        blocks = aq.reshape(-1, t8.type_size)   # block_q8_K: float d, int8 qs[256], bsums
        ad = (blocks[:, :4].copy().view(np.float32) *
              blocks[:, 4:4 + qk].copy().view(np.int8).astype(np.float32)).reshape(-1)
        out = np.full(1, np.nan, np.float32)
        cpu6.vec_dot(n, out.ctypes.data, 0, wq.ctypes.data, 0, aq.ctypes.data, 0, 1)
        prod = wd.astype(np.float64) * ad.astype(np.float64)
        err = abs(float(out[0]) - float(prod.sum()))
        assert err <= 1e-5 * float(np.abs(prod).sum()), \
            f"case {case}: Q6_K dot {out[0]!r} against {prod.sum()!r} dequantized"


@pytest.mark.parametrize("quant", QUANTS)
def test_weight_prefetch_changes_no_result(kdir, quant):
    assert child("prefetch_changes_nothing", str(kdir), quant) == "ok"


def test_one_token_kernels_ask_for_the_weights_ahead():
    """The x86 kernels of plain decoding (repacked Q4_K's gemv, the Q2_K-Q8_0 dots) carry
    patch 0013's read-ahead (Q4_0/IQ4_NL's repacked gemv is a static template, without a
    symbol in the wheel: its results are checked above, its speed in docs/kernels.md)."""
    import platform
    import shutil

    lib = library_file("ggml-cpu")
    if lib is None or shutil.which("objdump") is None or \
            platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("no x86 libggml-cpu in the installed package or no objdump")
    from specee_cpp.bindings import library_info

    if "AVX2 = 1" not in library_info()["system_info"]:
        pytest.skip("a build without the AVX2 kernels")
    for fn in ("ggml_gemv_q4_K_8x8_q8_K", "ggml_vec_dot_q2_K_q8_K", "ggml_vec_dot_q3_K_q8_K",
               "ggml_vec_dot_q4_K_q8_K", "ggml_vec_dot_q5_K_q8_K", "ggml_vec_dot_q6_K_q8_K",
               "ggml_vec_dot_q4_0_q8_0", "ggml_vec_dot_q5_0_q8_0", "ggml_vec_dot_q8_0_q8_0"):
        r = subprocess.run(["objdump", "-d", f"--disassemble={fn}", str(lib)],
                           capture_output=True, text=True, timeout=120)
        # the wheel's symbols are versioned: <name@@Base>
        assert r.returncode == 0 and re.search(rf"<{fn}(@@\w+)?>:", r.stdout), \
            f"{fn} not found: {r.stderr[:300]}"
        assert "prefetch" in r.stdout, f"{fn} asks for no weights ahead (patch 0013)"

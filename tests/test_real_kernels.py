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

from specee_cpp.bindings import library_file

HERE = Path(__file__).parent
QUANTS = ["Q4_0", "Q4_K", "Q6_K", "IQ4_NL"]


@pytest.fixture(scope="module")
def kdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def child(*args: str, timeout: float = 300) -> str:
    r = subprocess.run([sys.executable, str(HERE / "kernel_checks.py"), *args], cwd=HERE,
                       capture_output=True, text=True, timeout=timeout,
                       env={k: v for k, v in os.environ.items() if k != "RK_EXTRA"})
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


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
def test_small_batches_on_repacked_q4_k_equal_one_row_decodes(kdir, monkeypatch):
    # patch 0011 takes a batch against repacked Q4_K weights several rows at once (2-15 rows
    # in an AVX-512 build without VNNI, any number with AVX2 alone or AVX-512 VNNI), and the
    # 1-3 rows the 4-row gemm leaves of a longer one: each row must equal that token decoded
    # alone (upstream's gemm differs by ~0.2 from 4 rows on). With AVX2 alone patch 0016's
    # kernel runs them: 2-4 rows in registers, more in groups of 2-4 per block, 32 rows a
    # pass (33 = 32 + 1, 38 = 32 + 3 + 3); with AVX-512 VNNI patch 0018's, two strips of
    # columns at once (the tiny head's 40 strips leave 5 a chunk: the odd one takes 0011's
    # kernel). With AMX on, the AMX buffer takes these weights: switch it off so the repack
    # runs.
    from specee_cpp.bindings import library_info
    from specee_cpp.provenance import repack_fused_default

    monkeypatch.setenv("GGML_CPU_NO_AMX", "1")
    monkeypatch.delenv("GGML_REPACK_FUSED_ROWS", raising=False)
    info = library_info()["system_info"]
    limited = repack_fused_default("AVX512 = 1" in info, "AVX512_VNNI = 1" in info) is not None
    sizes = "2,3,4,5,9,15" + ("" if limited else ",16,33,38")
    zeros = " ".join(["0"] * len(sizes.split(",")))
    assert child("small_batch_rows", str(kdir), "Q4_K", sizes) == zeros
    # a limit of 3: batches of 4 and more take the gemm and the rows it leaves go together;
    # those rows attend to the gemm's rows, so they differ from one-at-a-time decodes as
    # upstream's do, but by exactly as much as upstream's (its gemv row by row, limit 0)
    monkeypatch.setenv("GGML_REPACK_FUSED_ROWS", "3")
    together = child("small_batch_rows", str(kdir), "Q4_K", "2,3,6,7,11", "tail")
    monkeypatch.setenv("GGML_REPACK_FUSED_ROWS", "0")
    upstream = child("small_batch_rows", str(kdir), "Q4_K", "2,3,6,7,11", "tail")
    assert together == upstream and together.startswith("0 0 "), (together, upstream)


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 repacked kernels (AVX2, REPACK)")
@pytest.mark.parametrize("quant", ["IQ4_NL", "Q4_0"])
def test_small_batches_on_repacked_iq4_nl_and_q4_0_equal_one_row_decodes(kdir, monkeypatch,
                                                                         quant):
    # patch 0020 takes 2-3 rows against repacked IQ4_NL / Q4_0 weights (a draft's catch-up)
    # together, one pass over the weights: each row must equal that token decoded alone.
    # Batches of 4 and more take upstream's gemm, and the 2-3 rows it leaves go together:
    # those rows attend to the gemm's rows, so they differ from one-at-a-time decodes as
    # upstream's do, but by exactly as much as upstream's (its gemv row by row, limit 0)
    monkeypatch.setenv("GGML_CPU_NO_AMX", "1")
    monkeypatch.delenv("GGML_REPACK_FUSED_ROWS", raising=False)
    assert child("small_batch_rows", str(kdir), quant, "2,3") == "0 0"
    together = child("small_batch_rows", str(kdir), quant, "6,7,11", "tail")
    monkeypatch.setenv("GGML_REPACK_FUSED_ROWS", "0")
    upstream = child("small_batch_rows", str(kdir), quant, "6,7,11", "tail")
    assert together == upstream, (together, upstream)


@pytest.mark.skipif("not system_repacks_x86()", reason="no x86 AVX2 kernels")
def test_small_batches_on_q6_k_equal_one_row_decodes(kdir, monkeypatch):
    # patch 0012 runs each Q6_K weight row (not repacked on x86) against a batch's 2-16 rows
    # at once, instead of a dot per pair (and, from 8 rows, of llama.cpp's tiled matmul,
    # which differs by ~0.5): each row must equal that token decoded alone (with a wrong row
    # offset: "batch of 2 ... max |diff| 18.41"). On AVX-512 builds patch 0019 gives 1-8 rows
    # a kernel each (the count a constant) and the rest one with the count as a variable:
    # sizes on both sides of 8
    monkeypatch.setenv("GGML_CPU_NO_AMX", "1")
    monkeypatch.delenv("GGML_Q6_K_FUSED_ROWS", raising=False)
    sizes = "2,3,4,5,7,8,9,16"
    assert child("small_batch_rows", str(kdir), "Q6_K", sizes) == " ".join(["0"] * 8)


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
    """Patch 0014: x86's quantize_row_q8_K (AVX2; every K-quant matmul's activations) writes
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
    """Patch 0017: on AVX-512 builds the Q6_K dot (ggml's vec_dot for Q6_K, every plain
    token's head) runs in 512-bit steps that pair the AVX2 kernel's operands two by two.
    Checked here against the dot of both operands dequantized by ggml (float64 sums): a
    quant, scale or activation put in the wrong half is off by ~1/sqrt(n) of the sum of
    |products|, the kernel's own rounding by ~1e-7 of it. That every batch of 2-16 rows
    equals this dot bit for bit is the model test above; that this dot equals the AVX2
    kernel's bit for bit was checked when the patch was made (docs/kernels.md, patch 0017)."""
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


def test_weight_prefetch_starts_off_and_its_variable_sets_it():
    """Patch 0015's distance as the loaded package has it at import: GGML_CPU_PREFETCH unset
    (off until a model's measurement on the machine says otherwise: engine/read_ahead.py), 0
    or below (off), or a number of bytes."""
    code = "from specee_cpp.bindings import cpu_prefetch_bytes; print(cpu_prefetch_bytes())"

    def read(value: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_PREFETCH"}
        if value is not None:
            env["GGML_CPU_PREFETCH"] = value
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    assert read(None) == "0"
    assert read("0") == "0"
    assert read("-64") == "0"
    assert read("8192") == "8192"


def test_one_token_kernels_ask_for_the_weights_ahead():
    """The x86 kernels of plain decoding (repacked Q4_K's gemv, the Q2_K-Q8_0 dots) carry
    patch 0015's prefetch (Q4_0/IQ4_NL's repacked gemv is a static template, without a
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
        assert "prefetch" in r.stdout, f"{fn} asks for no weights ahead (patch 0015)"

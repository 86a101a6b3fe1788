"""The patched x86 kernels compiled for every instruction set they have code for, whatever
this machine runs: AVX2 alone, AVX-512 without VNNI (Skylake-class), AVX-512 VNNI, and AMX,
with GCC and with clang (macOS and Windows builds use clang; the test extra's ``ziglang``
ships one where the system has none). A kernel that does not compile for one (an intrinsic
outside its feature guard, a guard that names the wrong feature, a compiler-specific
construct without a fallback) fails here on any x86 host. Then each lower ISA this CPU
runs is run, not only compiled: the CPU backend built for it (scripts/build_cpu_variants.py)
in place of the wheel's, under the exactness checks that test_real_kernels.py runs on the
native one. Also: the AMX fused kernel's work split at several thread counts, and the
series checked against a llama.cpp checkout, as a rebase starts."""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scripts_path import load_script
from test_amx import gcc_major, need_sdist
from test_real_kernels import child, exact_then_upstream

build_wheel = load_script("build_wheel")
check_amx = load_script("check_amx_codegen")

AVX2 = ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-msse4.2"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512cd"]
ISAS = {"AVX2": AVX2, "AVX-512": AVX512, "AVX-512 VNNI": AVX512 + ["-mavx512vnni"]}
# the files our x86 patches change, compiled as the build compiles them
SOURCES = ["ggml-cpu/arch/x86/quants.c", "ggml-cpu/arch/x86/repack.cpp",
           "ggml-cpu/repack.cpp", "ggml-cpu/ggml-cpu.c"]
DEFINES = ["-DGGML_USE_CPU_REPACK", "-DGGML_USE_LLAMAFILE", "-DNDEBUG", "-D_GNU_SOURCE",
           "-D_XOPEN_SOURCE=600"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """ggml's sources with the whole series applied, as the wheel builds them."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 kernels")
    if gcc_major() is None:
        pytest.skip("no gcc/g++")
    need_sdist()
    return build_wheel.patched_tree(tmp_path_factory.mktemp("isa")) / "ggml" / "src"


def compilers() -> dict[str, tuple[list[str], list[str]] | None]:
    """name -> (C compiler, C++ compiler) commands, or None where this machine has none."""
    clang = None
    if shutil.which("clang") and shutil.which("clang++"):
        clang = (["clang"], ["clang++"])
    elif importlib.util.find_spec("ziglang") is not None:
        zig = [sys.executable, "-m", "ziglang"]
        clang = (zig + ["cc"], zig + ["c++"])
    return {"gcc": (["gcc", "-fopenmp"], ["g++", "-fopenmp"]), "clang": clang}


COMPILERS = compilers()


def compile_one(src: Path, path: str, flags: list[str], out: Path, compiler: str = "gcc") -> str:
    """The compiler's complaint, or "" when it built an object file."""
    c = path.endswith(".c")
    cc = COMPILERS[compiler]
    if cc is None:
        pytest.skip(f"no {compiler} here")
    cmd = [*cc[0 if c else 1], "-std=gnu11" if c else "-std=gnu++17", "-O2",
           *DEFINES, *flags, *(f"-I{src / d}" for d in (".", "..", "../include", "ggml-cpu")),
           "-c", str(src / path), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return "" if r.returncode == 0 else f"{path}: {r.stderr[-1500:]}"


@pytest.mark.parametrize("compiler", list(COMPILERS))
@pytest.mark.parametrize("isa", list(ISAS))
def test_the_x86_kernels_compile_for_every_isa(src, tmp_path, isa, compiler):
    outs = [tmp_path / (Path(s).name + ".o") for s in SOURCES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = [e for e in pool.map(
            lambda so: compile_one(src, so[0], ISAS[isa], so[1], compiler),
            zip(SOURCES, outs)) if e]
    assert not errors, "\n".join(errors)
    if shutil.which("objdump") is None:
        return
    # the row kernels of this ISA are the ones compiled: 512-bit registers in the Q6_K rows
    # kernel exactly where AVX-512 is on
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(outs[0])],
                         capture_output=True, text=True).stdout
    body = dis.split("<ggml_vec_dot_q6_K_q8_K_rows>:", 1)
    assert len(body) == 2, "no Q6_K rows kernel in the object"
    assert ("%zmm" in body[1].split("\n\n", 1)[0]) == (isa != "AVX2"), isa


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_the_amx_kernels_compile_with_either_compiler(src, tmp_path, compiler):
    out = tmp_path / "mmq.o"
    err = compile_one(src, "ggml-cpu/amx/mmq.cpp", ["-march=sapphirerapids"], out, compiler)
    if "sapphirerapids" in err:
        pytest.skip("this compiler cannot target AMX (-march=sapphirerapids)")
    assert not err, err


@pytest.mark.parametrize("branch", ["header macro", "own instruction"])
def test_the_amx_kernels_store_their_tile_configuration(src, tmp_path, branch):
    # patch 0003 routes _tile_loadd through GCC's internal macro; where a GCC no longer has
    # it, the instruction itself is written out: both must build and keep the stores
    mmq = src / "ggml-cpu" / "amx" / "mmq.cpp"
    if branch == "own instruction":
        text = mmq.read_text()
        assert "#if defined(_tile_loadd_internal)" in text
        mmq = mmq.with_name("mmq_own.cpp")
        mmq.write_text(text.replace("#if defined(_tile_loadd_internal)", "#if 0"))
    out = tmp_path / "mmq.o"
    err = compile_one(src, str(mmq.relative_to(src)), ["-march=sapphirerapids"], out)
    if "sapphirerapids" in err:
        pytest.skip("this compiler cannot target AMX (-march=sapphirerapids)")
    assert not err, err
    if shutil.which("objdump") is None:
        return
    ok, msg = check_amx.check_file(out)
    assert ok, msg


SPLIT_CHECK = r"""
#include "amx/rows-split.h"
#include <cstdio>
#include <vector>
// per line of stdin "n_batch M n_tiles nth": the items, how often each (batch, tile, row)
// is covered (least, most), and whether every item takes whole row groups (or the rest)
int main() {
    int n_batch, M, n_tiles, nth;
    while (std::scanf("%d %d %d %d", &n_batch, &M, &n_tiles, &nth) == 4) {
        const vnni_rows_split split(n_batch, M, n_tiles, nth);
        std::vector<int> seen((size_t) n_batch * n_tiles * M, 0);
        bool whole = true;
        for (int i = 0; i < split.items(); ++i) {
            const vnni_rows_item it = split.item(i);
            whole = whole && (it.rows % VNNI_ROWS_GROUP == 0 || it.row + it.rows == M);
            for (int t = it.tile; t < it.tile + it.tiles; ++t)
                for (int r = it.row; r < it.row + it.rows; ++r)
                    ++seen[((size_t) it.batch * n_tiles + t) * M + r];
        }
        int lo = 1 << 30, hi = 0;
        for (int v : seen) { lo = v < lo ? v : lo; hi = v > hi ? v : hi; }
        std::printf("%d %d %d %d %d %d\n", split.items(), lo, hi, (int) whole, split.tiles,
                    split.rows);
    }
}
"""


def test_the_fused_amx_kernel_gives_every_thread_work(src, tmp_path):
    # the fused rows path split a product over 64-column blocks only: a 256-wide K/V
    # projection was 4 items, so 12 of 16 threads (60 of 64) idled through it
    prog, exe = tmp_path / "split.cpp", tmp_path / "split"
    prog.write_text(SPLIT_CHECK)
    r = subprocess.run(["g++", "-std=c++17", "-O1", f"-I{src / 'ggml-cpu'}", str(prog), "-o",
                        str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    shapes = [(b, m, tiles, nth) for b in (1, 2) for tiles in (2, 16, 96, 560)
              for m in (2, 4, 8, 9, 16, 33, 64, 128, 512) for nth in (2, 16, 64)]
    out = subprocess.run([str(exe)], input="".join(f"{b} {m} {t} {n}\n" for b, m, t, n in shapes),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    for (b, m, tiles, nth), line in zip(shapes, out):
        items, lo, hi, whole, per_item_tiles, per_item_rows = map(int, line.split())
        what = f"{b} x {m} rows x {tiles} tiles, {nth} threads"
        assert lo == hi == 1, f"{what}: a piece of the product covered {lo}..{hi} times"
        assert whole, f"{what}: an item splits a group of rows"
        pieces = b * tiles * -(-m // 8)      # the smallest items: one tile, one group of rows
        assert items >= min(nth, pieces), f"{what}: {items} items"
        if b * -(-tiles // 4) >= nth:        # enough whole blocks: upstream's split stands
            assert (per_item_tiles, per_item_rows) == (4, m), what
    # the case above: 16 tiles (256 columns), a 64-row verification
    assert out[shapes.index((1, 64, 16, 16))].split()[0] == "16"
    assert out[shapes.index((1, 64, 16, 64))].split()[0] == "64"


def variants_root(cpu_variants) -> Path:
    """Where set-up put the builds of scripts/build_cpu_variants.py."""
    return Path(os.environ.get("SPECEE_CPP_CPU_VARIANTS") or
                build_wheel.home_dir() / "cpu-variants" / cpu_variants.cache_key())


def variant_library_dir(variant: str, tmp_path: Path) -> Path:
    """A copy of the installed wheel's libraries with the CPU backend built for ``variant``
    (scripts/build_cpu_variants.py, run by set-up) in place of the native one."""
    from specee_cpp.bindings import library_file

    cpu_variants = load_script("build_cpu_variants")
    if variant not in cpu_variants.runnable():
        pytest.skip(f"this CPU does not run {variant}")
    built = variants_root(cpu_variants) / variant / cpu_variants.LIBRARY
    assert built.is_file(), f"{built} missing: set-up builds it (scripts/build_cpu_variants.py)"
    lib = tmp_path / "lib"
    shutil.copytree(library_file("llama").parent, lib, symlinks=False)
    swapped = [p for p in lib.iterdir() if p.name.startswith(cpu_variants.LIBRARY)]
    assert swapped, f"no {cpu_variants.LIBRARY}* beside libllama"
    for p in swapped:   # every name the wheel ships it under (.so, .so.0, .so.0.x.y)
        shutil.copyfile(built, p)
    return lib


def run_check(lib: Path, *args: str) -> str:
    """A kernel check on the libraries in ``lib`` instead of the wheel's."""
    return child(*args, timeout=600,
                 env={"LLAMA_CPP_LIB_PATH": str(lib), "SPECEE_CPP_AMX": "0"})


@pytest.mark.parametrize("variant", ["AVX2", "AVX-512"])
def test_the_kernels_of_each_isa_this_cpu_runs_are_exact(variant, tmp_path):
    # the native wheel runs only this CPU's best ISA; the lower ones' kernels (AVX2's 32-row
    # pass, AVX-512 without VNNI's Q6_K and repack paths) run here from their own builds:
    # every verification size equals the one-token decode bit for bit, rows spanning 5-14
    # super-blocks, past the 512 keys where upstream splits a one-token decode's attention
    lib = variant_library_dir(variant, tmp_path)
    info = run_check(lib, "system_info")
    assert "AVX2 = 1" in info and "AVX512_VNNI = 1" not in info, info
    assert ("AVX512 = 1" in info) == (variant == "AVX-512"), info
    kdir = tmp_path / "models"
    kdir.mkdir()
    for quant in ("Q4_K", "Q6_K"):
        exact_then_upstream(run_check(lib, "small_batch_rows", str(kdir), quant, "1-70", "all",
                                      "wide", "600"))


def test_the_library_built_by_clang_is_exact(tmp_path):
    # macOS and Windows builds use clang; set-up builds the whole patched library with it
    # (the system's, or the test extra's ziglang) and the exactness checks run on that build
    cpu_variants = load_script("build_cpu_variants")
    if cpu_variants.clang() is None:
        pytest.skip("no clang here (Linux only)")
    built = variants_root(cpu_variants) / cpu_variants.CLANG
    assert (built / "libllama.so").is_file(), \
        f"{built} has no libllama.so: set-up builds it (scripts/build_cpu_variants.py)"
    assert b"clang version" in (built / "libllama.so").read_bytes()
    # native like the wheel: the same instruction sets on
    from specee_cpp.bindings import library_info

    def isa(info: str) -> set[str]:
        return {f.split(" = ")[0] for f in info.split(" | ") if f.endswith(" = 1") and
                f.split(" = ")[0] in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI",
                                      "AVX512", "AVX512_VNNI", "AVX512_VBMI", "AMX_INT8")}
    wheel = isa(library_info()["system_info"].replace("CPU : ", ""))
    assert wheel and isa(run_check(built, "system_info").replace("CPU : ", "")) == wheel
    kdir = tmp_path / "models"
    kdir.mkdir()
    for quant in ("Q4_K", "Q6_K"):
        exact_then_upstream(run_check(built, "small_batch_rows", str(kdir), quant, "1-70",
                                      "all", "wide", "600"))


def test_check_tree_says_which_patch_does_not_apply(tmp_path):
    """build_wheel.py --check-tree: the series against a llama.cpp checkout (say, a newer
    upstream), in order, without building and without touching it."""
    need_sdist()
    tree = build_wheel.patched_tree(tmp_path / "x", patches=[])   # the pinned checkout
    lines = build_wheel.check_tree(tree)
    assert [line.split(":")[0] for line in lines] == [p.name for p in build_wheel.patch_files()]
    assert all(line.endswith(": applies") for line in lines), lines
    # upstream moved a line the AMX patch edits: that patch is named, the others still apply
    mmq = tree / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    text = mmq.read_text()
    assert "#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)\n\nnamespace {" in text
    edited = text.replace("#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)\n\nnamespace {",
                          "#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)\n\n// moved\n"
                          "namespace {")
    mmq.write_text(edited)
    moved = build_wheel.check_tree(tree)
    assert moved[2].startswith("0003-") and "does not apply" in moved[2] and "mmq.cpp" in moved[2]
    assert moved[0].endswith(": applies")
    assert mmq.read_text() == edited   # the checkout as it was

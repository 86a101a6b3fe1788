"""The patched x86 kernels compiled for every instruction set they have code for, whatever
this machine runs: AVX2 alone, AVX-512 without VNNI (Skylake-class), AVX-512 VNNI, and AMX,
with GCC and with clang (macOS and Windows builds use clang; the test extra's ``ziglang``
ships one where the system has none). A kernel that does not compile for one (an intrinsic
outside its feature guard, a guard that names the wrong feature, a compiler-specific
construct without a fallback) fails here on any x86 host; test_real_kernels.py runs the
kernels of the ISA this host has. Also: the series checked against a llama.cpp checkout,
as a rebase starts."""
from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scripts_path import load_script
from test_amx import gcc_major, need_sdist

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

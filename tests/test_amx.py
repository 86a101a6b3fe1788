"""AMX: the GCC 12 tile-configuration miscompilation (patch 0003), its code check, the AMX
switch, and wheels keyed by the CPU they were built for."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts_path import load_script
from specee_cpp.bindings import library_file

REPO = Path(__file__).resolve().parent.parent


check = load_script("check_amx_codegen")
build_wheel = load_script("build_wheel")


def gcc_major() -> int | None:
    gxx = shutil.which("g++")
    if not gxx:
        return None
    out = subprocess.run([gxx, "-dumpversion"], capture_output=True, text=True).stdout
    return int(out.split(".")[0]) if out.strip() else None


def need_sdist() -> None:
    """Skip unless the pinned sdist that set-up downloads is here (the sources these tests
    compile or patch come from it)."""
    sdist = build_wheel.home_dir() / "sdist" / \
        f"llama_cpp_python-{build_wheel.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        pytest.skip(f"no sdist at {sdist} (set-up downloads it)")


@pytest.fixture(scope="module")
def ggml_src(tmp_path_factory) -> Path:
    """The pinned llama.cpp sources, unpatched."""
    need_sdist()
    if gcc_major() is None:
        pytest.skip("no g++")
    return build_wheel.patched_tree(tmp_path_factory.mktemp("ggml"), patches=[])


def compile_mmq(src: Path, out: Path) -> Path:
    inc = [f"-I{src / d}" for d in ("ggml/include", "ggml/src", "ggml/src/ggml-cpu")]
    cmd = ["g++", "-std=c++17", "-O3", "-march=sapphirerapids", "-DNDEBUG", "-DGGML_USE_CPU",
           *inc, "-c", str(src / "ggml/src/ggml-cpu/amx/mmq.cpp"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and "sapphirerapids" in r.stderr:
        pytest.skip("this compiler cannot target AMX (-march=sapphirerapids)")
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_codegen_check_catches_the_miscompilation_and_patch_0003_fixes_it(ggml_src, tmp_path):
    before = compile_mmq(ggml_src, tmp_path / "before.o")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(ggml_src.parent))
    patch = REPO / "patches" / "0003-amx-tile-stores-and-switch.patch"
    subprocess.run(["git", "apply", str(patch)], cwd=ggml_src, env=env, check=True)
    after = compile_mmq(ggml_src, tmp_path / "after.o")
    ok_after, msg_after = check.check_file(after)
    assert ok_after and "stored before ldtilecfg" in msg_after, msg_after
    ok_before, msg_before = check.check_file(before)
    if gcc_major() == 12:  # the compiler the bug was found with: the check must see it
        assert not ok_before and "miscompiled" in msg_before, msg_before


def test_check_reads_a_miscompiled_sequence():
    broken = """0000000000001000 <f>:
    1000:	vpxor  %xmm0,%xmm0,%xmm0
    1004:	vmovdqa64 %zmm0,0xc0(%rsp)
    100c:	movb   $0x1,0xc0(%rsp)
    1014:	ldtilecfg 0xc0(%rsp)
"""
    fixed = broken.replace("    1014:", "    1010:	vmovdqa 0x0(%rip),%xmm0\n    1012:	vmovdqa %xmm0,0xd0(%rsp)\n    1014:")
    found, problems = check.check_disassembly(broken)
    assert found == 1 and len(problems) == 1 and "<f>" not in problems[0] and "f:" in problems[0]
    assert check.check_disassembly(fixed) == (1, [])


def test_installed_library_passes_the_codegen_check():
    lib = library_file("ggml-cpu")
    if lib is None or shutil.which("objdump") is None:
        pytest.skip("no libggml-cpu in the installed package or no objdump")
    ok, msg = check.check_file(lib)
    assert ok, msg


def system_has_amx() -> bool:
    from specee_cpp.bindings import library_info

    return bool(re.search(r"AMX_INT8 = 1", library_info()["system_info"]))


@pytest.mark.skipif("not system_has_amx()", reason="this CPU/build has no AMX (AMX_INT8 = 0)")
def test_amx_kernels_match_plain_kernels(tmp_path):
    # with AMX compiled in and on, the extra buffer is AMX: compare with extra buffers off
    from test_real_kernels import child

    for quant in ("Q4_0", "Q4_K", "Q6_K"):
        assert child("real_kernels", str(tmp_path), quant) == "ok"


@pytest.mark.skipif("not system_has_amx()", reason="this CPU/build has no AMX (AMX_INT8 = 0)")
def test_small_batches_on_amx_equal_one_row_decodes(tmp_path):
    # patch 0009 computes 2-4 row batches (verifications) row by row with the one-row
    # kernel, patch 0010 Q4_K/Q6_K batches several rows at once: each row must be that
    # token's own row, equal to decoding it alone (a wrong row offset or group split would
    # repeat a row or read another row's activations)
    from kernel_checks import BATCH_ROWS
    from test_real_kernels import child

    for quant in ("Q4_0", "Q4_K", "Q6_K"):
        assert child("small_batch_rows", str(tmp_path), quant) == \
            " ".join("0" for _ in BATCH_ROWS), quant


def test_native_wheel_key_follows_the_cpu(monkeypatch):
    args = build_wheel.DEFAULT_CMAKE_ARGS
    monkeypatch.setattr(build_wheel, "cpu_features", lambda: "avx2 fma")
    k1 = build_wheel.cache_key([], args)
    monkeypatch.setattr(build_wheel, "cpu_features", lambda: "amx_int8 amx_tile avx2 fma")
    k2 = build_wheel.cache_key([], args)
    assert k1 != k2  # another CPU: cache miss
    generic = args + ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]
    k3 = build_wheel.cache_key([], generic)
    monkeypatch.setattr(build_wheel, "cpu_features", lambda: "avx2 fma")
    assert build_wheel.cache_key([], generic) == k3  # a generic build is shared
    assert build_wheel.is_native(args) and not build_wheel.is_native(generic)
    monkeypatch.undo()
    assert len(build_wheel.cpu_features().split()) > 1  # this machine's real feature list


def test_peer_tools_carry_patch_0003_and_pass_the_codegen_check():
    """llama.cpp's own tools (the bench's peers) get patch 0003 and no other: built stock, the
    first AMX matrix multiply of each died with SIGILL on a 2-core Xeon with AMX (exit -4,
    `tinygemm_kernel_amx`), so no peer ran there."""
    from specee_cpp.bench.peers import TOOLS, tools_dir
    from specee_cpp.errors import SpeceeError

    build_peers = load_script("build_peers")
    assert [p.name for p in build_peers.PATCHES] == ["0003-amx-tile-stores-and-switch.patch"]
    try:
        tools = tools_dir()
    except SpeceeError as e:
        pytest.skip(f"llama.cpp's tools are not built: {e}")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    for t in TOOLS:
        ok, msg = check.check_file(tools / build_peers.exe(t))
        assert ok, msg

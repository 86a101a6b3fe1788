#!/usr/bin/env python3
"""Build (or reuse) the patched library as the wheel does not: the CPU backend, libggml-cpu,
for each x86 instruction set below this CPU's that it can run (AVX2 alone, and AVX-512
without VNNI, Skylake-class), and the whole library compiled by clang.

The wheel is built for the CPU it runs on (-march=native) by the system's compiler (GCC on
Linux), so on an AVX-512 VNNI machine its AVX2 and plain AVX-512 kernels are compiled out and
never run, and clang (macOS, Windows builds) never compiles it. tests/test_isa_matrix.py
puts each build made here in place of the wheel's libraries (``LLAMA_CPP_LIB_PATH``) and
runs the kernel exactness checks on it.

Same sources as the wheel (the pinned sdist with every patch applied), shared, Release. An
ISA variant is the ggml-cpu target alone, ``-DGGML_NATIVE=OFF`` with the variant's options;
the clang build is the llama target (with every ggml library it links), native, without
OpenMP (zig's clang has none), by the system's clang or the ``ziglang`` package's. Cached
under ``<home>/cpu-variants/<key>/<variant>/``; the key hashes the version, this script, the
patches, the platform, this CPU's features (which variants it runs) and the clang found.
Prints the folder holding one subfolder per variant built on its last line of stdout.

Standard library only, like build_wheel.py, whose sdist and patch steps it shares.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_wheel import (LLAMA_CPP_PYTHON_VERSION, BuildError, cpu_features,  # noqa: E402
                         home_dir, log, patch_files, patched_tree, print_built)
from cmake_build import cmake_build  # noqa: E402

# variant -> (CPU flags it needs, as /proc/cpuinfo spells them; its CMake options)
AVX2_FLAGS = ["avx", "avx2", "fma", "f16c", "bmi2"]
AVX2_OPTIONS = ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
                "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_INT8=OFF"]
VARIANTS = {
    "AVX2": (AVX2_FLAGS, AVX2_OPTIONS),
    "AVX-512": (AVX2_FLAGS + ["avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"],
                [o.replace("-DGGML_AVX512=OFF", "-DGGML_AVX512=ON") for o in AVX2_OPTIONS]),
}
COMMON_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
                  "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                  "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                  "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"]
LIBRARY = {"win32": "ggml-cpu.dll", "darwin": "libggml-cpu.dylib"}.get(sys.platform,
                                                                      "libggml-cpu.so")


CLANG = "clang"
# native, as the wheel is (COMMON_OPTIONS' GGML_NATIVE=OFF would make it an AVX2 build)
CLANG_OPTIONS = [o for o in COMMON_OPTIONS if not o.startswith("-DGGML_NATIVE=")] + [
    "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN"]


def runnable() -> list[str]:
    """The ISA variants this CPU can run (none off x86 or off Linux, where the flags are
    read)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            not sys.platform.startswith("linux"):
        return []
    have = set(cpu_features().split())
    return [name for name, (flags, _) in VARIANTS.items() if have.issuperset(flags)]


def clang() -> list[str] | None:
    """The C and C++ compiler commands of a clang (the system's, else the ``ziglang``
    package's), or None. Linux only: the checks swap shared libraries by their .so names."""
    if not sys.platform.startswith("linux"):
        return None
    if shutil.which("clang") and shutil.which("clang++"):
        return [shutil.which("clang"), shutil.which("clang++")]
    import importlib.util
    spec = importlib.util.find_spec("ziglang")
    if spec is None or spec.origin is None:
        return None
    zig = Path(spec.origin).parent / "zig"
    return [f"{zig} cc", f"{zig} c++"] if zig.is_file() else None


def clang_version() -> str:
    """The clang's own version line ("" without one): what the cache key holds of it, so
    that the same clang found at another path (another checkout's venv) reuses the build."""
    cc = clang()
    if cc is None:
        return ""
    r = subprocess.run([*cc[0].split(" "), "--version"], capture_output=True, text=True)
    return (r.stdout.splitlines() or [""])[0]


def planned() -> list[str]:
    """What this machine builds: its runnable ISA variants, and clang's where one is here."""
    return runnable() + ([CLANG] if clang() else [])


def cache_key() -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n".encode())
    h.update(Path(__file__).read_bytes())
    for p in patch_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"{sys.platform} {platform.machine()} {' '.join(runnable())}".encode())
    h.update(clang_version().encode())
    return h.hexdigest()[:16]


def build(out_dir: Path, variants: list[str]) -> Path:
    work = Path(tempfile.mkdtemp(prefix="specee-cpu-variants-"))
    try:
        src = patched_tree(work / "src")
        staging = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in variants:
            bld = work / f"build-{name}"
            env = dict(os.environ)
            if name == CLANG:
                args, target = CLANG_OPTIONS, "llama"
                env["CC"], env["CXX"] = clang()
                log(f"building the library with clang ({env['CC']}); about 5-8 min on 2 "
                    f"cores")
            else:
                args, target = COMMON_OPTIONS + VARIANTS[name][1], "ggml-cpu"
                log(f"building libggml-cpu for {name} ({' '.join(VARIANTS[name][1])}); "
                    f"about 1 min on 2 cores")
            t0 = time.time()
            cmake_build(src, bld, args, [target], work / f"build-{name}.log", env, name)
            wanted = "lib*.so*" if name == CLANG else LIBRARY
            found = sorted(p for p in bld.rglob(wanted) if p.is_file())
            if not found:
                raise BuildError(f"{wanted} not found under {bld} after the build")
            (staging / name).mkdir()
            if name == CLANG:   # each library once, its other names linked to it
                for p in found:
                    if p.is_symlink():
                        os.symlink(os.readlink(p), staging / name / p.name)
                    else:
                        shutil.copy2(p, staging / name / p.name)
            else:
                shutil.copy2(found[0], staging / name / LIBRARY)
            log(f"built {name} in {time.time() - t0:.0f} s")
        (staging / "build.json").write_text(json.dumps({
            "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "variants": variants,
            "patches": [p.name for p in patch_files()], "cmake_args": COMMON_OPTIONS,
            "clang": clang(), "clang_cmake_args": CLANG_OPTIONS,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)  # an interrupted build leaves no half-filled entry
        return out_dir
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cached_variants(force: bool = False) -> Path:
    variants = planned()
    out_dir = home_dir() / "cpu-variants" / cache_key()
    if not force and (out_dir / "build.json").is_file():
        log(f"reusing the CPU backend variants in {out_dir}")
        return out_dir
    if not variants:
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir
    return build(out_dir, variants)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ns = ap.parse_args()
    return print_built(lambda: cached_variants(ns.force))


if __name__ == "__main__":
    sys.exit(main())

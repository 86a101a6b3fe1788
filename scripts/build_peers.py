#!/usr/bin/env python3
"""Build (or reuse) llama.cpp's own speculative tools, the peers `specee-cpp bench` compares
against: llama-speculative-simple (draft model and n-gram speculation), llama-lookup and
llama-lookup-create (prompt n-gram lookup, optionally with a static n-gram cache), and the
kernel checks' unpatched reference (one_row_logits.c). With
``--server``, llama-server instead (the peer of ``specee-cpp serve`` in
scripts/load_test.py), cached apart: only the load test needs it.

They are built from the llama.cpp sources vendored in the same pinned llama-cpp-python
sdist as our wheel, without our patches (the peers are what a user would get) but one:
patch 0003, the compiler barrier without which GCC 12 drops the stores of ggml's AMX tile
configuration (docs/kernels.md). A stock build dies with SIGILL in its first AMX matrix
multiply on an AMX CPU (seen on a 2-core Xeon with AMX: `tinygemm_kernel_amx`, exit -4),
so no peer would run there; the barrier emits no instruction and changes no result, and
its switch (``SPECEE_CPP_AMX=0``) does nothing unless set. Every binary is checked like the
wheel (check_amx_codegen.py). Statically linked, with ``CMAKE_ARGS`` passed through (e.g.
``-DGGML_CUDA=ON``). Cached under ``<home>/tools/<key>/``; the key hashes the version, this
script, the patch, the CMake options and the platform. Prints the directory holding the
binaries on its last line of stdout.

Standard library only, like build_wheel.py, whose sdist download it shares.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_wheel import (LLAMA_CPP_PYTHON_VERSION, PATCH_DIR, BuildError,  # noqa: E402
                         apply_patches, fetch_sdist, home_dir, log, print_built)
from check_amx_codegen import check_file  # noqa: E402
from cmake_build import cmake_build  # noqa: E402

# the exactness checks' reference (tests/kernel_checks.py): one-row logits from these
# unpatched sources, built as one more example program
REFERENCE = "specee-one-row-logits"
REFERENCE_SOURCE = Path(__file__).resolve().parent / "one_row_logits.c"
TARGETS = ["llama-speculative-simple", "llama-lookup", "llama-lookup-create", REFERENCE]
SERVER = ["llama-server"]
# what the peers get of ours: the AMX miscompilation fix, nothing that changes llama.cpp
PATCHES = [PATCH_DIR / "0003-amx-tile-stores-and-switch.patch"]
DEFAULT_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",       # self-contained binaries: nothing to find at run time
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",           # the peers read local files only
]


def exe(name: str) -> str:
    return name + (".exe" if sys.platform == "win32" else "")


def cmake_args(server: bool = False) -> list[str]:
    args = DEFAULT_CMAKE_ARGS
    if server:   # the server lives among the tools
        args = [a for a in args if not a.startswith(("-DLLAMA_BUILD_TOOLS=",
                                                      "-DLLAMA_BUILD_SERVER="))]
        args += ["-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON"]
    return args + os.environ.get("CMAKE_ARGS", "").split()


def cache_key(args: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n".encode())
    h.update(Path(__file__).read_bytes())
    h.update(REFERENCE_SOURCE.read_bytes())
    for p in PATCHES:
        h.update(p.read_bytes())
    h.update(" ".join(args).encode())
    h.update(f"{sys.platform} {platform.machine()} {platform.processor()}".encode())
    return h.hexdigest()[:16]


def add_reference(src: Path) -> None:
    """The reference program as one more of the tree's examples (linked like them)."""
    d = src / "examples" / REFERENCE
    d.mkdir()
    shutil.copy2(REFERENCE_SOURCE, d / REFERENCE_SOURCE.name)
    (d / "CMakeLists.txt").write_text(
        f"add_executable({REFERENCE} {REFERENCE_SOURCE.name})\n"
        f"target_link_libraries({REFERENCE} PRIVATE llama)\n")
    with open(src / "examples" / "CMakeLists.txt", "a") as fh:
        fh.write(f"\nadd_subdirectory({REFERENCE})\n")


def build(out_dir: Path, args: list[str], targets: list[str]) -> Path:
    sdist = fetch_sdist(home_dir() / "sdist")
    work = Path(tempfile.mkdtemp(prefix="specee-peers-"))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(work, members=members)
        src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        apply_patches(src, PATCHES)
        add_reference(src)
        bld = work / "build"
        log(f"building {', '.join(targets)} (CMake options: {' '.join(args)}); "
            f"about 4-6 min on 2 cores")
        t0 = time.time()
        cmake_build(src, bld, args, targets, work / "build.log")
        log(f"built in {time.time() - t0:.0f} s")
        staging = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for t in targets:
            found = [p for p in bld.rglob(exe(t)) if p.is_file()]
            if not found:
                raise BuildError(f"{exe(t)} not found under {bld} after the build")
            shutil.copy2(found[0], staging / exe(t))
            ok, msg = check_file(staging / exe(t))
            if not ok:
                raise BuildError(msg)
            log(msg)
        (staging / "build.json").write_text(json.dumps({
            "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "targets": targets,
            "patches": [p.name for p in PATCHES],
            "cmake_args": args, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)  # an interrupted build leaves no half-filled entry
        return out_dir
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cached_tools(force: bool = False, server: bool = False) -> Path:
    args, targets = cmake_args(server), SERVER if server else TARGETS
    out_dir = home_dir() / "tools" / cache_key(args)
    if not force and all((out_dir / exe(t)).is_file() for t in targets):
        log(f"reusing cached llama.cpp tools in {out_dir}")
        return out_dir
    return build(out_dir, args, targets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--server", action="store_true",
                    help="build llama-server (the load test's peer) instead")
    ns = ap.parse_args()
    return print_built(lambda: cached_tools(force=ns.force, server=ns.server))


if __name__ == "__main__":
    sys.exit(main())

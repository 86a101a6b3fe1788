#!/usr/bin/env python3
"""Build (or reuse) the patched llama-cpp-python wheel.

Steps: fetch the pinned llama-cpp-python sdist (no binaries), unpack it, apply every file
in ``patches/`` in name order inside ``vendor/llama.cpp``, build a wheel with ``CMAKE_ARGS``
passed through, and cache it under ``<home>/wheels/<key>/``. The key hashes the
llama-cpp-python version, this script, the patches, the CMake options and the platform, so a second
set-up with the same inputs reuses the wheel in seconds.

Standard library only: this runs before any virtual environment exists.
Prints the path of the wheel on its last line of stdout.
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
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REPO = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO / "patches"

# Parts of llama.cpp that the Python package never loads: skipping them roughly halves the
# build. LLAMA_BUILD_COMMON is forced on by llama-cpp-python's CMakeLists and cannot be cut.
DEFAULT_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
]


class BuildError(RuntimeError):
    pass


def home_dir() -> Path:
    return Path(os.environ.get("SPECEE_CPP_HOME") or Path.home() / ".cache" / "specee-cpp")


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def cmake_args() -> list[str]:
    user = os.environ.get("CMAKE_ARGS", "").split()
    return DEFAULT_CMAKE_ARGS + user


def cpu_features() -> str:
    """The instruction-set extensions of this CPU, as one sorted string.

    A native build (-march=native, llama.cpp's default GGML_NATIVE=ON) runs only on CPUs with
    the same extensions: two machines of one 'x86_64' kind may differ (AVX-512, AMX)."""
    flags: set[str] = set()
    try:
        if sys.platform.startswith("linux"):
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86 / ARM
                    flags.update(value.split())
                    break
        elif sys.platform == "darwin":
            for name in ("machdep.cpu.features", "machdep.cpu.leaf7_features",
                         "machdep.cpu.brand_string", "hw.optional.arm64"):
                r = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True)
                flags.update(f"{name}={v}" for v in r.stdout.split())
    except OSError:
        pass
    if not flags:  # Windows and the rest: the processor identification string
        flags.add(platform.processor() or "unknown")
    return " ".join(sorted(flags))


def is_native(args: list[str]) -> bool:
    """Whether the build targets this CPU (GGML_NATIVE, on unless switched off)."""
    native = True
    for a in args:
        if a.upper().startswith("-DGGML_NATIVE="):
            native = a.split("=", 1)[1].strip().upper() not in ("OFF", "0", "FALSE", "NO")
    return native


def cache_key(patches: list[Path], args: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n".encode())
    h.update(Path(__file__).read_bytes())  # a change of this recipe is a new build too
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(args).encode())
    h.update(f"{sys.platform} {platform.machine()} {platform.processor()}".encode())
    if is_native(args):
        # -march=native: the wheel is valid only on CPUs with this feature set; a cache
        # shared between machines (or a home folder copied over) must miss, not crash
        h.update(cpu_features().encode())
    return h.hexdigest()[:16]


def log(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def fetch_sdist(dest: Path) -> Path:
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    path = dest / name
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist")
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / name
        if not got.exists():
            raise BuildError(f"could not download the llama-cpp-python sdist:\n{r.stdout}{r.stderr}")
        os.replace(got, path)  # atomic: no half-written sdist under the final name
    return path


def apply_patches(vendor: Path, patches: list[Path]) -> None:
    # The sdist is itself a git checkout; `git apply` run inside it would treat
    # vendor/llama.cpp as a subdirectory and silently skip every path of our patches. Stop
    # repository discovery at vendor/llama.cpp so that git applies to plain files there.
    gitfile = vendor / ".git"
    if gitfile.is_file():
        gitfile.unlink()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(vendor.parent))
    for p in patches:
        r = subprocess.run(["git", "apply", "--verbose", str(p)], cwd=vendor, env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to llama.cpp of llama-cpp-python"
                             f" {LLAMA_CPP_PYTHON_VERSION}:\n{r.stderr.strip()}")
        # A patch that "applied" but changed nothing would give a silently stock build.
        check = subprocess.run(["git", "apply", "--reverse", "--check", str(p)], cwd=vendor,
                               env=env, capture_output=True, text=True)
        if check.returncode != 0:
            raise BuildError(f"patch {p.name} reported success but is not in the tree:\n"
                             f"{check.stderr.strip()}")
        log(f"applied {p.name}")


def patched_tree(dest: Path, patches: list[Path] | None = None) -> Path:
    """The pinned llama.cpp sources with the series applied, under ``dest`` (its path
    returned): what the wheel compiles, for checks that compile parts of it themselves."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(fetch_sdist(home_dir() / "sdist")) as tar:
        tar.extractall(dest, members=[m for m in tar.getmembers()
                                      if m.name.startswith(prefix)])
    vendor = dest / prefix
    apply_patches(vendor, patch_files() if patches is None else patches)
    return vendor


def check_tree(tree: Path) -> list[str]:
    """Whether the series applies, in order, to the llama.cpp checkout at ``tree`` (say, a
    newer upstream to rebase onto), without building and without touching it: each patch's
    name, then "applies" or why not. Patches after the first that fails are checked against
    the tree as far as it got."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "llama.cpp"
        shutil.copytree(tree, work, ignore=shutil.ignore_patterns(".git", "build*"))
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(work.parent))
        for p in patch_files():
            r = subprocess.run(["git", "apply", str(p)],
                               cwd=work, env=env, capture_output=True, text=True)
            why = [line for line in r.stderr.splitlines() if line.startswith("error:")]
            out.append(f"{p.name}: " + ("applies" if r.returncode == 0 else
                                        "does not apply: " + "; ".join(why[:3])))
    return out


def stamp_version(src: Path, key: str) -> None:
    """Give the wheel a local version label so `pip list` and `doctor` show the build."""
    init = src / "llama_cpp" / "__init__.py"
    text = init.read_text()
    old = f'__version__ = "{LLAMA_CPP_PYTHON_VERSION}"'
    if old not in text:
        raise BuildError(f"unexpected version line in {init}")
    init.write_text(text.replace(old, f'__version__ = "{LLAMA_CPP_PYTHON_VERSION}+specee.{key}"'))


def build(out_dir: Path, key: str, patches: list[Path], args: list[str]) -> Path:
    sdist = fetch_sdist(home_dir() / "sdist")
    work = Path(tempfile.mkdtemp(prefix="specee-build-"))
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(work)
        src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        apply_patches(src / "vendor" / "llama.cpp", patches)
        stamp_version(src, key)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        log(f"building wheel (CMAKE_ARGS={env['CMAKE_ARGS']}); about 5-10 min on 2 cores")
        t0 = time.time()
        wheel_tmp = work / "wheel"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheel_tmp), str(src)]
        build_log = work / "build.log"
        with open(build_log, "w") as fh:
            r = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = build_log.read_text(errors="replace")[-6000:]
            raise BuildError(f"wheel build failed (exit {r.returncode}); last lines:\n{tail}")
        wheels = list(wheel_tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"expected one wheel in {wheel_tmp}, found {wheels}")
        log(f"built in {time.time() - t0:.0f} s")
        check_amx(wheels[0], work / "amx-check")
        # Write under a temporary name, then rename: an interrupted build leaves no entry.
        staging = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copy2(wheels[0], staging / wheels[0].name)
        (staging / "build.json").write_text(json.dumps({
            "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
            "patches": [p.name for p in patches],
            "cmake_args": args,
            "key": key,
            "native": is_native(args),
            "cpu_features": cpu_features() if is_native(args) else None,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }, indent=2))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
        return out_dir / wheels[0].name
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_amx(wheel: Path, scratch: Path) -> None:
    """Refuse a wheel whose AMX kernels would fault: see check_amx_codegen.py."""
    import zipfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_amx_codegen import check_file

    with zipfile.ZipFile(wheel) as z:
        seen: set[int] = set()  # versioned copies of one library: check it once
        for info in z.infolist():
            name = Path(info.filename).name
            if not name.startswith(("libggml-cpu", "ggml-cpu")) or info.CRC in seen or \
                    not any(ext in name for ext in (".so", ".dylib", ".dll")):
                continue
            seen.add(info.CRC)
            lib = Path(z.extract(info, scratch))
            ok, msg = check_file(lib)
            if not ok:
                raise BuildError(msg)
            log(msg)


def cached_wheel(force: bool = False, stock: bool = False) -> Path:
    patches = [] if stock else patch_files()
    args = cmake_args()
    key = cache_key(patches, args)
    out_dir = home_dir() / "wheels" / key
    found = sorted(out_dir.glob("*.whl")) if out_dir.is_dir() else []
    if found and not force:
        log(f"reusing cached wheel {found[0].name} (key {key})")
        return found[0]
    return build(out_dir, key, patches, args)


def print_built(build: Callable[[], Path]) -> int:
    """A build script's ending: the built path on stdout (what bootstrap.py reads), or one
    line on stderr and exit status 1."""
    try:
        print(build())
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--key", action="store_true", help="print the cache key and exit")
    ap.add_argument("--stock", action="store_true",
                    help="build without patches (the baseline for benchmarks)")
    ap.add_argument("--check-tree", type=Path, metavar="DIR",
                    help="check that the patches apply to the llama.cpp checkout DIR, in "
                         "order, without building (DIR is not changed)")
    ns = ap.parse_args()
    if ns.check_tree:
        if not (ns.check_tree / "ggml").is_dir():
            print(f"error: {ns.check_tree} is not a llama.cpp checkout (no ggml/)",
                  file=sys.stderr)
            return 1
        lines = check_tree(ns.check_tree)
        print("\n".join(lines))
        return 0 if all(line.endswith(": applies") for line in lines) else 1
    if ns.key:
        print(cache_key([] if ns.stock else patch_files(), cmake_args()))
        return 0
    return print_built(lambda: cached_wheel(force=ns.force, stock=ns.stock))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""One prepared GPU check: build the patched llama.cpp for CUDA, run the patch's tests with
every layer offloaded, measure the cost model on models shaped like the default pair, and
replay the profiled acceptance through the draft-length controller with those costs.

A GPU machine is lent now and then, for minutes, without network, and with at most 64 MiB
travelling to it, so the check is split in two:

    python scripts/gpu_check.py prepare            # here: pruned, patched sources + wheels
                                                   #   -> .gpu-check/ (carried to the GPU)
    python scripts/gpu_check.py run --out DIR      # there: build, test, measure, replay
    python scripts/gpu_check.py --cpu --out DIR    # prepare + run on the CPU backend with
                                                   #   small shapes: the same code path (CI)
    python scripts/gpu_check.py publish DIR        # here, after a GPU run: DIR -> docs/gpu/
                                                   #   and its tables into docs/BENCHMARKS.md

On a lent GPU machine (docs/gpu-check.md): the device tool's run with
``carry=[".gpu-check"]``, ``timeout_s=600`` and the command
``python3 scripts/gpu_check.py run --out $OUT/gpu-check --budget-s 540``.

Pruning: of the pinned llama-cpp-python sdist (76 MB) only the Python package ``llama_cpp``
and the parts of ``vendor/llama.cpp`` that building ``libllama`` reads are kept (its CMake
files, ``include``, ``src``, ``vendor``, and ``ggml`` with the CPU, CUDA and BLAS backends),
our patches are applied to them (every hunk must apply: a pruned file would fail here, not
on the GPU), and the tree is packed into one deterministic tarball. ``MANIFEST.json`` lists
its size and sha256; ``prepare`` fails if it and the wheels exceed the carry budget.

Output (``--out``): ``gpu_check.json`` (everything) and ``gpu_check.md`` (tables), with the
wall time of each step; the run stops adding steps before ``--budget-s`` (default 12 min).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_wheel  # noqa: E402  (same folder: sdist fetch, patch apply)

PREP = REPO / ".gpu-check"
CARRY_BUDGET = 48 * 2**20          # of the 64 MiB a call carries: the repo takes ~5 MiB
SDIST_ROOT = f"llama_cpp_python-{build_wheel.LLAMA_CPP_PYTHON_VERSION}"
# what building libllama reads, relative to vendor/llama.cpp (everything else is left out)
KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "vendor/",
        "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/")
KEEP_GGML_SRC_DIRS = ("ggml-cpu", "ggml-cuda", "ggml-blas")
# pure-Python (or cp312 manylinux) wheels the GPU machine's Python may lack; unpacked there
# only for the modules it cannot import
WHEELS = {"gguf": "gguf==0.19.0", "yaml": "pyyaml", "diskcache": "diskcache",
          "typing_extensions": "typing_extensions", "jinja2": "jinja2",
          "markupsafe": "markupsafe", "pytest": "pytest", "pluggy": "pluggy",
          "iniconfig": "iniconfig", "packaging": "packaging", "_pytest": "pytest"}
GPU_PYTHON = "3.12"

# the default pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft) and small ones for --cpu
SHAPES = {
    "full": {"target": dict(n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960),
             "draft": dict(n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864),
             "n_vocab": 151936},
    "small": {"target": dict(n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=512),
              "draft": dict(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256),
              "n_vocab": 4096},
}
QUANT = "Q4_K_M"                   # both models of the default pair are Q4_K_M files
PATCH_TESTS = ["tests/test_staged_tiny.py", "tests/test_bindings_tiny.py"]


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- prepare (here) -------------------------------------------------------------------------

def keep_member(rel: str) -> bool:
    """Whether a path of the sdist is needed to build libllama and import llama_cpp."""
    if rel.startswith("llama_cpp/"):
        return "/lib/" not in rel and not rel.endswith((".so", ".dylib", ".dll"))
    if not rel.startswith("vendor/llama.cpp/"):
        return False
    r = rel[len("vendor/llama.cpp/"):]
    if r.startswith(KEEP):
        return True
    if r.startswith("ggml/src/"):
        sub = r[len("ggml/src/"):]
        return "/" not in sub or sub.split("/")[0] in KEEP_GGML_SRC_DIRS
    return False


def deterministic_tar(root: Path, out: Path) -> None:
    """Pack ``root`` sorted, with fixed owners and times: the same tree gives the same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(root.rglob("*")):
            if p.is_dir():
                continue
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(p, "rb") as f:
                tar.addfile(info, f)
    import gzip

    with open(out, "wb") as f:
        with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, compresslevel=9) as gz:
            gz.write(buf.getvalue())


def prepare(dest: Path = PREP, wheels: bool = True) -> dict:
    """Pruned, patched sources (+ wheels) under ``dest``; returns the manifest."""
    t0 = time.perf_counter()
    patches = build_wheel.patch_files()
    sdist = build_wheel.fetch_sdist(build_wheel.home_dir() / "sdist")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "src"
        n_kept = n_all = 0
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                if not m.isfile() or not m.name.startswith(SDIST_ROOT + "/"):
                    continue
                n_all += 1
                rel = m.name[len(SDIST_ROOT) + 1:]
                if keep_member(rel):
                    n_kept += 1
                    target = tree / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        vendor = tree / "vendor" / "llama.cpp"
        # every hunk must apply to the pruned tree, and be found there afterwards
        build_wheel.apply_patches(vendor, patches)
        # the Python package says it is a patched build, as the wheel's does
        build_wheel.stamp_version(tree, "gpucheck" + hashlib.sha256(
            b"".join(p.read_bytes() for p in patches)).hexdigest()[:12])
        tarball = dest / "llama-src.tar.gz"
        deterministic_tar(tree, tarball.with_suffix(".tmp"))
        tarball.with_suffix(".tmp").replace(tarball)
    wheel_files = download_wheels(dest / "wheels") if wheels else []
    # the real pair's tensor types, where its files are here, to compare with what the
    # quantizer makes of the shape-matched models on the GPU machine
    real_types = {}
    try:
        sys.path.insert(0, str(REPO))
        from specee_cpp.models.registry import load_registry

        for role, entry in zip(("target", "draft"), load_registry().pair("default")):
            if entry.local_path.is_file():
                real_types[role] = {"file": entry.file,
                                    "types": tensor_types(entry.local_path)}
    except ImportError:   # prepare may run before set-up: the comparison is then left out
        pass
    total = tarball.stat().st_size + sum(w.stat().st_size for w in wheel_files)
    manifest = {"sdist": sdist.name, "sdist_bytes": sdist.stat().st_size,
                "files_in_sdist": n_all, "files_kept": n_kept,
                "patches": [p.name for p in patches],
                "patches_sha256": hashlib.sha256(b"".join(p.read_bytes() for p in patches)
                                                 ).hexdigest(),
                "tarball_bytes": tarball.stat().st_size, "tarball_sha256": sha256(tarball),
                "wheels": sorted(w.name for w in wheel_files), "total_bytes": total,
                "real_types": real_types,
                "prepare_s": round(time.perf_counter() - t0, 1)}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    if total > CARRY_BUDGET:
        raise SystemExit(f"error: {dest} holds {total / 2**20:.1f} MiB, over the "
                         f"{CARRY_BUDGET / 2**20:.0f} MiB carry budget")
    log(f"prepared {dest}: {n_kept} of {n_all} sdist files, tarball "
        f"{tarball.stat().st_size / 2**20:.1f} MiB, {len(wheel_files)} wheels, "
        f"{total / 2**20:.1f} MiB in all")
    return manifest


def download_wheels(dest: Path) -> list[Path]:
    """Wheels for the GPU machine's Python (manylinux x86_64), from the package index."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = sorted(set(WHEELS.values()))
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
           "--no-deps", "--only-binary=:all:", "--python-version", GPU_PYTHON,
           "--implementation", "cp", "--platform", "manylinux2014_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
           "-d", str(dest), *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: could not download the wheels for the GPU machine:\n"
                         f"{r.stderr.strip()[-2000:]}")
    return sorted(dest.glob("*.whl"))


# ---- run (on the GPU machine, or on CPU with --cpu) -----------------------------------------

class Steps:
    """Timed steps with a wall budget: each prints its time; a step that would start after
    the budget is skipped and recorded as such."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.times: dict[str, float] = {}
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def run(self, name: str, fn, *args, min_left_s: float = 0.0, **kw):
        if self.left() < min_left_s:
            log(f"skipped {name}: {self.left():.0f} s of the budget left")
            self.skipped.append(name)
            return None
        t = time.perf_counter()
        log(f"{name} ...")
        try:
            return fn(*args, **kw)
        finally:
            self.times[name] = round(time.perf_counter() - t, 1)
            log(f"{name}: {self.times[name]:.1f} s (total {time.perf_counter() - self.t0:.0f} s)")


def gpu_arch() -> str | None:
    """CMAKE_CUDA_ARCHITECTURES for the GPUs nvidia-smi lists (e.g. '90'), None if none."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap,name,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = sorted({line.split(",")[0].strip().replace(".", "")
                   for line in r.stdout.splitlines() if line.strip()})
    return ";".join(caps) or None


def unpack(prep: Path, work: Path) -> Path:
    """The pruned tree under ``work/src`` (again only if the tarball changed)."""
    tarball = prep / "llama-src.tar.gz"
    if not tarball.is_file():
        raise SystemExit(f"error: {tarball} is missing: run `python scripts/gpu_check.py "
                         f"prepare` first (and carry .gpu-check to the GPU machine)")
    digest = sha256(tarball)
    src = work / "src"
    stamp = work / "src.sha256"
    if not (stamp.exists() and stamp.read_text() == digest and src.is_dir()):
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(src, filter="data") if sys.version_info >= (3, 12) \
                else tar.extractall(src)
        stamp.write_text(digest)
    return src


def cmake_build(src: Path, build: Path, cuda_arch: str | None, jobs: int,
                with_fa: bool = False) -> Path:
    """Configure and build libllama (shared) with ninja where there is one; returns the
    folder holding the libraries. Reuses a build folder made with the same options."""
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
            "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON"]
    if cuda_arch:
        # one architecture, no NCCL (one GPU); FlashAttention's ~120 template instances
        # roughly double the build, so they are left out unless asked for (--with-fa): decode
        # then takes llama.cpp's other attention path
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}",
                 "-DGGML_CUDA_NCCL=OFF", f"-DGGML_CUDA_FA={'ON' if with_fa else 'OFF'}"]
    args += os.environ.get("CMAKE_ARGS", "").split()
    key = hashlib.sha256(json.dumps([args, (src.parent / "src.sha256").read_text()
                                     if (src.parent / "src.sha256").exists() else ""]).encode()
                         ).hexdigest()[:16]
    stamp = build / "specee-build.key"
    lib_dir = build / "bin"
    if stamp.exists() and stamp.read_text() == key and any(lib_dir.glob("*llama*")):
        log(f"reusing the build in {build}")
        return lib_dir
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = ["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build), *gen, *args]
    run_logged(cfg, build.parent / "cmake-configure.log")
    run_logged(["cmake", "--build", str(build), "--target", "llama", "-j", str(jobs)],
               build.parent / "cmake-build.log")
    stamp.write_text(key)
    return lib_dir


def run_logged(cmd: list[str], log_path: Path, env: dict | None = None) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"error: {' '.join(cmd[:3])} ... failed (exit {r.returncode}); "
                         f"log {log_path}:\n{tail}")


def python_path(src: Path, prep: Path, work: Path) -> list[str]:
    """Where the child processes import from: the pruned llama_cpp package, this repository,
    and the carried wheels of the modules this Python lacks (unpacked, no pip needed)."""
    import importlib.util

    paths = [str(src), str(REPO)]
    # the children run this same interpreter: what it cannot find, they cannot import
    lacking = [m for m in WHEELS if importlib.util.find_spec(m) is None]
    if lacking:
        pylib = work / "pylib"
        pylib.mkdir(parents=True, exist_ok=True)
        wanted = {WHEELS[m].split("==")[0].lower().replace("-", "_") for m in lacking}
        for whl in sorted((prep / "wheels").glob("*.whl")):
            if whl.name.split("-")[0].lower() in wanted:
                with zipfile.ZipFile(whl) as z:
                    z.extractall(pylib)
        paths.append(str(pylib))
        log(f"unpacked wheels for {', '.join(sorted(lacking))}")
    return paths


def child_env(lib_dir: Path, paths: list[str], gpu: bool) -> dict:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir),
               PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
               SPECEE_CPP_TEST_GPU_LAYERS="-1" if gpu else "0", PYTHONUNBUFFERED="1")
    # the build's own libggml* next to libllama, found before any other on the system
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib_dir), env.get("LD_LIBRARY_PATH", "")])
    return env


def run_check(out: Path, cpu: bool, budget_s: float, prep: Path = PREP,
              work: Path | None = None, jobs: int = 0, with_fa: bool = False) -> dict:
    steps = Steps(budget_s)
    out.mkdir(parents=True, exist_ok=True)
    cuda_arch = None if cpu else gpu_arch()
    if not cpu and cuda_arch is None:
        raise SystemExit("error: no NVIDIA GPU found (nvidia-smi); use --cpu for the CPU path")
    gpu = cuda_arch is not None
    work = work or (build_wheel.home_dir() / "gpu-check" if cpu else REPO / ".gpu-check" / "work")
    jobs = jobs or os.cpu_count() or 2
    src = steps.run("unpack", unpack, prep, work)
    lib_dir = steps.run("build", cmake_build, src, work / ("build-cuda" if gpu else "build-cpu"),
                        cuda_arch, jobs, with_fa)
    paths = python_path(src, prep, work)
    env = child_env(lib_dir, paths, gpu)
    report: dict = {"backend": f"CUDA (sm {cuda_arch}{', FlashAttention' if with_fa else ''})"
                    if gpu else "CPU",
                    "platform": platform.platform(), "python": platform.python_version(),
                    "manifest": json.loads((prep / "MANIFEST.json").read_text())
                    if (prep / "MANIFEST.json").exists() else None}
    report["load"] = steps.run("load probe", load_probe, env, out, gpu, min_left_s=60)
    tests = steps.run("patch tests", run_tests, env, out, min_left_s=60)
    report["tests"] = tests
    shapes = "small" if cpu else "full"
    measured = steps.run("measure", run_measure, env, out, shapes, jobs, min_left_s=90)
    report["measure"] = measured
    report["steps_s"] = steps.times
    report["skipped"] = steps.skipped
    report["total_s"] = round(time.perf_counter() - steps.t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    log(f"wrote {out / 'gpu_check.json'} and gpu_check.md in {report['total_s']:.0f} s")
    return report


# ways of loading one tiny model, each in its own process: where the default load crashes,
# the ones that do not say which part of loading does (extra CPU buffer types, the GPU's
# pinned host buffers, the mapped file, the architecture query made before loading, our log
# callback)
LOAD_VARIANTS = ("default", "cpu-only", "no-extra-bufts", "no-host", "no-mmap",
                 "no-arch-query", "llama-log")


def load_probe(env: dict, out: Path, gpu: bool) -> dict:
    """Load and decode a tiny model under each of LOAD_VARIANTS in a child process; the exit
    codes, and the tail of each child's llama.cpp log, go to ``load-probe.log``."""
    from specee_cpp.models.tiny import write_tiny_model

    model = out / "load-probe.gguf"
    write_tiny_model(model, arch="qwen2", n_layer=2, seed=3)
    env = dict(env, SPECEE_CPP_VERBOSE="1")
    result, lines = {}, []
    for v in LOAD_VARIANTS:
        cmd = [sys.executable, str(Path(__file__).resolve()), "load", str(model),
               "--variant", v] + ([] if gpu else ["--cpu"])
        try:
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=180)
            rc, said, log_tail = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, said, log_tail = "timeout", e.stdout or "", e.stderr or ""
            said, log_tail = [x.decode(errors="replace") if isinstance(x, bytes) else x
                              for x in (said, log_tail)]
        result[v] = rc
        # how far it got (stdout), then the end of llama.cpp's log (stderr)
        lines += ([f"== {v}: exit {rc}"] + said.strip().splitlines()
                  + log_tail.strip().splitlines()[-40:])
    if gpu and result["default"] != 0 and shutil.which("gdb"):
        cmd = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable,
               str(Path(__file__).resolve()), "load", str(model), "--variant", "default"]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
        lines += ["== default under gdb"] + (r.stdout + r.stderr).strip().splitlines()[-60:]
    (out / "load-probe.log").write_text("\n".join(lines) + "\n")
    model.unlink()
    log("load probe: " + ", ".join(f"{k} {v}" for k, v in result.items()))
    return result


def load_child(model: str, variant: str, gpu: bool) -> None:
    """One load and decode of ``model`` the way ``variant`` says (a child of load_probe)."""
    from specee_cpp.bindings import Batch, Context, Model, _ffi
    from specee_cpp.bindings import llama as wrappers

    ll = wrappers.ll
    if variant == "no-host":
        default_params = ll.llama_model_default_params

        def params():
            p = default_params()
            p.no_host = True
            return p
        ll.llama_model_default_params = params
    elif variant == "no-arch-query":
        _ffi.llama_specee_arch_supported = lambda name: True
    elif variant == "llama-log":
        ll.llama_log_set(ll.llama_log_callback(0), None)   # llama.cpp's own stderr log
    kw = dict(n_gpu_layers=0 if variant == "cpu-only" or not gpu else -1,
              use_extra_bufts=variant != "no-extra-bufts", use_mmap=variant != "no-mmap")
    print(f"loading {model} with {kw}", flush=True)
    m = Model(model, **kw)
    print("loaded", flush=True)
    ctx = Context(m, n_ctx=64, n_batch=16, n_threads=2)
    b = Batch(16)
    b.set([1, 40, 41, 42], 0)
    ctx.decode(b)
    print("decoded", flush=True)


def run_tests(env: dict, out: Path) -> dict:
    """The patch's tests (tiny GGUFs), every layer offloaded on a GPU; the junit XML and
    the log go to ``out``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           f"--junitxml={out / 'patch-tests.xml'}", *PATCH_TESTS]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out / "patch-tests.log").write_text(r.stdout + r.stderr)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    log(f"patch tests: {last}")
    return {"returncode": r.returncode, "summary": last}


def run_measure(env: dict, out: Path, shapes: str, jobs: int) -> dict | None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "measure", "--out", str(out),
           "--shapes", shapes, "--jobs", str(jobs)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out / "measure.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        log(f"measure failed (exit {r.returncode}), log {out / 'measure.log'}:\n"
            f"{r.stderr[-2000:]}")
        return {"returncode": r.returncode, "error": r.stderr.strip()[-500:]}
    return json.loads((out / "measure.json").read_text())


# ---- measure (child process: imports the freshly built library) ----------------------------

def write_shaped(path: Path, arch_shape: dict, n_vocab: int, seed: int) -> Path:
    """A random-weight qwen2 GGUF of exactly this shape (tied embeddings, as the default
    pair), written in F16 with a synthetic vocabulary of ``n_vocab`` tokens."""
    from specee_cpp.models.tiny import write_tiny_model

    return write_tiny_model(path, arch="qwen2", seed=seed, n_vocab=n_vocab, f16=True,
                            tied=True, scale=0.02, n_ctx_train=32768, **arch_shape)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type a GGUF holds."""
    from collections import Counter

    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def measure(out: Path, shapes: str, jobs: int) -> dict:
    """Models of the pair's shapes, their cost table with every layer offloaded, the staged
    decode's exits and probes, and the controller replay with those costs."""
    from specee_cpp.bindings.quantize import quantize
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.draft_attention import choose
    from specee_cpp.engine.llm import LLM
    from specee_cpp.speculative.cost import measure_table

    gpu_layers = int(os.environ.get("SPECEE_CPP_TEST_GPU_LAYERS", "0"))
    spec = SHAPES[shapes]
    res: dict = {"shapes": shapes, "gpu_layers": gpu_layers, "times_s": {}}
    clock = time.perf_counter
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        files = {}
        for role, seed in (("target", 1), ("draft", 2)):
            t = clock()
            (Path(tmp) / role).mkdir()
            f16 = write_shaped(Path(tmp) / role / f"{role}.gguf", spec[role], spec["n_vocab"],
                               seed)
            q, _ = quantize(f16, QUANT, Path(tmp), n_threads=jobs)
            f16.unlink()
            files[role] = q
            res[f"{role}_types"] = tensor_types(q)
            res["times_s"][f"write+quantize {role}"] = round(clock() - t, 1)
        t = clock()
        cfg = LoadConfig(n_ctx=2048, n_gpu_layers=gpu_layers, n_threads=min(jobs, 8))
        with LLM(files["target"], draft=files["draft"], config=cfg) as llm:
            # a short context to start from (measure_table repeats it to 128 and 1024 tokens)
            tokens = llm.model.tokenize("the cat sat on the mat. " * 8, add_special=True)[:32]
            # the draft's attention as the runtime chooses it (engine/draft_attention.py)
            fa, seen = choose(llm.dft.model, cfg.threads, tokens, n_batch=cfg.n_batch)
            llm.set_draft_flash_attn(fa)
            res["draft_attention"] = dict(seen, chosen="off" if fa is False else "default")
            table = measure_table(llm.tgt.seq, llm.dft.seq, tokens)
            res["times_s"]["cost table"] = round(clock() - t, 1)
            res["costs"] = [cost_summary(p) for p in table.points]
            t = clock()
            res["staged"] = staged_costs(llm, tokens)
            res["times_s"]["staged exits and probes"] = round(clock() - t, 1)
            res["replay"] = replay(table.points[0], llm.model.bits_per_weight)
    (out / "measure.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return res


def cost_summary(cm) -> dict:
    v1 = cm.plain
    return {"context": cm.context, "plain_token_ms": round(1e3 * v1, 3),
            "draft_token_rel": round(cm.draft_token_s / v1, 3),
            "verify_rel": {str(n): round(cm.verify(n) / v1, 3) for n in range(1, 17)},
            "raw": {"target_batch_s": cm.target_batch_s, "draft_token_s": cm.draft_token_s,
                    "plain_token_s": cm.plain_token_s, "draft_first_s": cm.draft_first_s}}


# probes and exits of the staged decode, at the layers of the 28-layer target (scaled to
# another layer count): probes where SpecEE's predictors fire, exits from early to late
PROBE_LAYERS_28 = [13, 15, 17, 19, 21, 23, 25, 26]
EXIT_LAYERS_28 = [8, 14, 20, 24, 27]


def staged_configs(n_layer: int) -> dict:
    """name -> (kind, argument): plain decoding, the staged decode in one segment, 8 probed
    segments, and exits at five layers with and without the LM head."""
    scale = n_layer / 28
    probes = sorted({min(n_layer - 2, round(l * scale)) for l in PROBE_LAYERS_28})
    exits = sorted({min(n_layer - 1, round(l * scale)) for l in EXIT_LAYERS_28})
    cfg = {"plain": ("plain", None), "staged-full": ("segments", [n_layer]),
           "probes-8": ("segments", probes + [n_layer])}
    for l in exits:
        cfg[f"exit-{l}+head"] = ("exit", (l, True))
        cfg[f"exit-{l}"] = ("exit", (l, False))
    return cfg


def time_staged(ctx, seq_tokens, kind, arg, n_tokens, cand) -> float:
    """Seconds per token of ``n_tokens`` single-token decodes of one configuration after
    ``seq_tokens``; the KV cache is left as it was."""
    from specee_cpp.bindings import Batch

    b = Batch(1)
    n = len(seq_tokens)
    t0 = time.perf_counter()
    for i in range(n_tokens):
        b.set([seq_tokens[i % n]], n + i)
        if kind == "plain":
            ctx.decode(b)
        elif kind == "segments":
            ctx.stage_begin(b)
            for il in arg:
                ctx.stage_run(il, cand)
        else:
            layer, head = arg
            ctx.stage_begin(b)
            ctx.stage_run(layer, cand)
            ctx.stage_exit(full_head=head)
    dt = (time.perf_counter() - t0) / n_tokens
    ctx.seq_rm(n)
    return dt


def staged_costs(llm, tokens: list[int], n_tokens: int = 32) -> dict:
    """Seconds per token of the staged decode's configurations, as ratios to plain decoding
    timed in the same loop."""
    ctx = llm.tgt.ctx
    seq = llm.tgt.seq
    seq.rewind(0)
    seq.prefill(tokens, read=False)
    n_layer = llm.model.n_layer
    cand = [tokens[i % len(tokens)] for i in range(4)]
    cfgs = staged_configs(n_layer)
    times: dict[str, list[float]] = {k: [] for k in cfgs}
    for name, (kind, arg) in cfgs.items():      # warm-up of every graph shape
        time_staged(ctx, tokens, kind, arg, 2, cand)
    for _ in range(3):
        for name, (kind, arg) in cfgs.items():
            times[name].append(time_staged(ctx, tokens, kind, arg, n_tokens, cand))
    med = {k: float(sorted(v)[len(v) // 2]) for k, v in times.items()}
    seq.rewind(0)
    return {"n_layer": n_layer, "plain_ms": round(1e3 * med["plain"], 3),
            "rel": {k: round(v / med["plain"], 3) for k, v in med.items() if k != "plain"}}


def replay(costs, bpw: float) -> dict:
    """The profiled rounds (docs/controller, Q4_K_M target) under each policy with these
    costs; controllers cross-fitted in 4 folds by prompt, as speckv_ladder.py does."""
    from specee_cpp.records import records
    from specee_cpp.speculative import acceptance, policies, simulate as sim
    from specee_cpp.speculative.mode import parse_gamma

    recs = records(REPO / "docs" / "controller" / f"profile-{QUANT}.jsonl",
                   what="profile file")
    ids = sorted({r["prompt_id"] for r in recs})
    folds = [set(ids[i::4]) for i in range(4)]
    models = [acceptance.fit([r for r in recs if r["prompt_id"] not in f]) for f in folds]
    out = {}
    for name in ("1", "2", "3", "4", "6", "8", "pmin", "hf", "speckv", "auto", "stop"):
        tokens = seconds = drafted = rounds = 0.0
        plain_tps = 1.0
        for fold, model in zip(folds, models):
            part = [r for r in recs if r["prompt_id"] in fold]
            rep = sim.replay(part, lambda: policies.make_policy(
                parse_gamma(name), model=model, costs=costs, bpw=bpw), costs)
            tokens, seconds = tokens + rep.tokens, seconds + rep.seconds
            drafted, rounds = drafted + rep.drafted, rounds + rep.rounds
            plain_tps = rep.plain_tps
        out[name] = {"speedup": round(tokens / seconds / plain_tps, 3),
                     "mean_gamma": round(drafted / max(rounds, 1), 2)}
    return {"rounds": len(recs), "policies": out}


# ---- report ---------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    lines = [f"# GPU check: {r['backend']}", "",
             f"Platform {r['platform']}, Python {r['python']}; total {r['total_s']:.0f} s. "
             f"Steps (s): " + ", ".join(f"{k} {v}" for k, v in r["steps_s"].items())
             + (f"; skipped for time: {', '.join(r['skipped'])}" if r["skipped"] else "") + ".",
             ""]
    if r.get("load"):
        lines += ["Load probe (exit code per way of loading a tiny model): "
                  + ", ".join(f"{k} {v}" for k, v in r["load"].items()) + ".", ""]
    t = r.get("tests") or {}
    lines += [f"Patch tests (every layer offloaded where a GPU is): exit {t.get('returncode')}, "
              f"`{t.get('summary')}`.", ""]
    m = r.get("measure") or {}
    if "costs" in m:
        real = (r.get("manifest") or {}).get("real_types") or {}
        seen = "; ".join(f"the real {k} ({v['file']}): {v['types']}" for k, v in real.items())
        lines += [f"Models: random weights in the default pair's shapes ({m['shapes']}), "
                  f"quantized to {QUANT} here: target types {m['target_types']}, draft types "
                  f"{m['draft_types']}" + (f" (for comparison, {seen})" if seen else "")
                  + f". Times (s): {m['times_s']}.", "",
                  "| context | plain token ms | draft token / target | verify 2 | 4 | 8 | 16 |",
                  "|---|---|---|---|---|---|---|"]
        for c in m["costs"]:
            v = c["verify_rel"]
            lines.append(f"| {c['context']} | {c['plain_token_ms']} | {c['draft_token_rel']} | "
                         + " | ".join(str(v[str(n)]) for n in (2, 4, 8, 16)) + " |")
        a = m.get("draft_attention")
        if a:
            from specee_cpp.engine.draft_attention import describe

            chosen = False if a["chosen"] == "off" else None
            lines += ["", f"Draft attention: {describe(chosen, a, digits=2)}."]
        s = m["staged"]
        lines += ["", f"Staged decode ({s['n_layer']} layers), time per token relative to "
                      f"plain decoding ({s['plain_ms']} ms):", "",
                  "| configuration | vs plain |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in s["rel"].items()]
        p = m["replay"]
        lines += ["", f"Controller replay of {p['rounds']} profiled rounds (Q4_K_M target, dev "
                      f"prompts; acceptance from the CPU profiles, costs measured here): speed "
                      f"vs plain (mean drafted tokens per round).", "",
                  "| policy | " + " | ".join(p["policies"]) + " |",
                  "|---|" + "---|" * len(p["policies"]),
                  "| speed-up | " + " | ".join(f"{v['speedup']:.2f} ({v['mean_gamma']})"
                                             for v in p["policies"].values()) + " |"]
    elif m:
        lines += [f"Measurement failed: {m.get('error')}"]
    return "\n".join(lines) + "\n"


def publish(folder: Path | None) -> None:
    """Copy a GPU run's JSON and markdown into docs/gpu/ and its tables into BENCHMARKS.md."""
    if folder is None or not (folder / "gpu_check.json").is_file():
        raise SystemExit(f"error: no gpu_check.json in {folder}: name a run's output folder")
    dest = REPO / "docs" / "gpu"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_check.json", "gpu_check.md", "load-probe.log", "patch-tests.log",
                 "measure.log"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, dest / name)
    from specee_cpp.bench.report import write_section

    body = (folder / "gpu_check.md").read_text().split("\n", 1)[1].strip()
    write_section(REPO / "docs" / "BENCHMARKS.md", "GPU",
                  "`python3 scripts/gpu_check.py run` (docs/gpu-check.md); raw output in "
                  "`docs/gpu/`.\n\n" + body + "\n")
    log(f"published {folder} to {dest} and docs/BENCHMARKS.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", nargs="?", choices=["prepare", "run", "measure", "publish", "load"],
                    default="run")
    ap.add_argument("folder", nargs="?", type=Path,
                    help="publish: the run's output folder; load: the model")
    ap.add_argument("--variant", choices=LOAD_VARIANTS, default="default",
                    help="load: how to load (one of the load probe's ways)")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU backend, small shapes (prepares first): the path CI tests")
    ap.add_argument("--out", type=Path, default=REPO / "gpu-check-out")
    ap.add_argument("--budget-s", type=float, default=720.0,
                    help="wall budget of the whole run; later steps are skipped past it")
    ap.add_argument("--jobs", type=int, default=0, help="build and quantize threads (0: all)")
    ap.add_argument("--shapes", choices=list(SHAPES), default="full")
    ap.add_argument("--no-wheels", action="store_true", help="prepare: skip the wheels")
    ap.add_argument("--with-fa", action="store_true",
                    help="CUDA: also build the FlashAttention kernels (about twice the build)")
    ns = ap.parse_args()
    if ns.step == "prepare":
        prepare(wheels=not ns.no_wheels)
        return 0
    if ns.step == "publish":
        publish(ns.folder)
        return 0
    if ns.step == "load":
        load_child(str(ns.folder), ns.variant, gpu=not ns.cpu)
        return 0
    if ns.step == "measure":
        measure(ns.out, ns.shapes, ns.jobs or os.cpu_count() or 2)
        return 0
    if ns.cpu:
        prepare(wheels=not ns.no_wheels)
    report = run_check(ns.out.resolve(), ns.cpu, ns.budget_s, jobs=ns.jobs, with_fa=ns.with_fa)
    ok = (report.get("tests") or {}).get("returncode") == 0 and \
        "costs" in (report.get("measure") or {})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

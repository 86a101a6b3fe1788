#!/usr/bin/env python3
"""One-command set-up of specee-cpp, then run something.

    python scripts/bootstrap.py setup            # venv, patched wheel, package, crash probe, default models
    python scripts/bootstrap.py chat [ARGS...]   # set up, then `specee-cpp chat` on the default pair
    python scripts/bootstrap.py test [ARGS...]   # set up (test model, peer tools, CPU variants), then pytest

Every step is skipped when its result is already there: the patched wheel is cached under
``$SPECEE_CPP_HOME/wheels`` (see build_wheel.py), the package install is stamped with the
hash of its inputs, and `pull` keeps verified models. Standard library only.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SPECEE_CPP_VENV") or REPO / ".venv")
TEST_MODELS = ["smollm2-135m"]


def log(msg: str) -> None:
    print(f"[setup] {msg}", file=sys.stderr, flush=True)


def venv_bin(name: str) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    suffix = ".exe" if os.name == "nt" else ""
    return VENV / sub / (name + suffix)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], **kw)
    if r.returncode != 0:
        log(f"failed ({r.returncode}): {' '.join(map(str, cmd))}")
        sys.exit(r.returncode)
    return r


def ensure_venv() -> Path:
    py = venv_bin("python")
    if not py.exists():
        log(f"creating virtual environment {VENV}")
        venv.EnvBuilder(with_pip=True).create(VENV)
    return py


def ensure_packages(py: Path) -> None:
    wheel = run([py, REPO / "scripts" / "build_wheel.py"], stdout=subprocess.PIPE,
                text=True).stdout.strip().splitlines()[-1]
    stamp_src = hashlib.sha256()
    for f in ("pyproject.toml",):
        stamp_src.update((REPO / f).read_bytes())
    stamp_src.update(wheel.encode())
    stamp = VENV / ".specee-cpp-installed"
    if stamp.exists() and stamp.read_text() == stamp_src.hexdigest():
        return
    log(f"installing {Path(wheel).name} and specee-cpp into {VENV}")
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    # The patched wheel first, so that the package's llama-cpp-python==0.3.36 pin is met by it
    # instead of pip fetching and building the stock sdist.
    run(pip + ["--force-reinstall", "--no-deps", wheel])
    run(pip + [wheel, "-e", f"{REPO}[server,test]"])
    stamp.write_text(stamp_src.hexdigest())


def ensure_probe(py: Path) -> None:
    """One short decode of a tiny model in a child process after each new install: a build
    that crashes on this CPU stops set-up here, with one line, not at the user's first
    prompt. Repeated only when the install or the AMX switch changes."""
    install = VENV / ".specee-cpp-installed"
    key = (install.read_text() if install.exists() else "") + os.environ.get("SPECEE_CPP_AMX", "")
    stamp = VENV / ".specee-cpp-probed"
    if stamp.exists() and stamp.read_text() == key:
        return
    log("crash probe: a short decode of a tiny model in a child process")
    r = subprocess.run([str(py), "-m", "specee_cpp.crash_probe"], stdout=subprocess.PIPE, text=True)
    line = (r.stdout.strip().splitlines() or ["crash probe gave no output"])[-1]
    if r.returncode != 0:
        print(line if line.startswith("error:") else f"error: {line}", file=sys.stderr)
        sys.exit(1)
    log(line)
    stamp.write_text(key)


def pull(names: list[str]) -> None:
    # --quick: trust the verification stamps, so that a set-up that finds its models starts
    # in seconds (`specee-cpp pull` alone hashes them again)
    run([venv_bin("specee-cpp"), "pull", "--quick", *names])


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("setup", "chat", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    action, rest = argv[0], argv[1:]
    py = ensure_venv()
    ensure_packages(py)
    ensure_probe(py)
    if action == "test":
        pull(TEST_MODELS)
        # the benchmark tests run llama.cpp's own speculative tools (built once, cached)
        tools = run([py, REPO / "scripts" / "build_peers.py"], stdout=subprocess.PIPE,
                    text=True).stdout.strip().splitlines()[-1]
        os.environ["SPECEE_CPP_TOOLS"] = tools
        # the CPU backend for each lower x86 ISA this CPU runs, for the kernel checks
        variants = run([py, REPO / "scripts" / "build_cpu_variants.py"],
                       stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
        os.environ["SPECEE_CPP_CPU_VARIANTS"] = variants
        cmd = [py, "-m", "pytest", *(rest or ["-q", str(REPO / "tests")])]
    else:
        pull(["--pair", "default"])
        if action == "setup":
            log(f"ready: {venv_bin('specee-cpp')}")
            return 0
        cmd = [venv_bin("specee-cpp"), "chat", *rest]
    # Replace this process so that Ctrl-C and the exit code belong to the command itself.
    if os.name == "nt":
        return subprocess.call([str(c) for c in cmd])
    os.execv(str(cmd[0]), [str(c) for c in cmd])
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where a measurement was taken: CPU, its features as llama.cpp sees them, threads, build, pages.

Costs differ between machines, even between two of one kind (AVX-512, AMX, repacked
kernels), so every benchmark, profile, cost and calibration record carries this and every
report prints it: figures from different machines never mix silently.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re

from .memory import huge_pages_wanted, thp_mode

# The CPU kernel switches the patches add (bindings.KERNEL_SWITCHES), each set by hand with
# SPECEE_CPP_<name> when the library starts; 0 is off (upstream's kernel) for every one.
SWITCH_ENV = "SPECEE_CPP_{}"
AMX_ENV = SWITCH_ENV.format("AMX")   # 0: weights stay out of the AMX buffer (--no-amx)


def switch_set(name: str) -> int | None:
    """The value this process's environment gives kernel switch ``name``, read as the
    library reads it (the leading digits of a value that starts with one), else None."""
    m = re.match(r"\d+", os.environ.get(SWITCH_ENV.format(name), ""))
    return int(m.group()) if m else None


def switches_set() -> list[str]:
    """The kernel switches set by hand in this environment, as NAME=value (AMX aside: the
    machine records it as its own fact)."""
    from .bindings import KERNEL_SWITCHES

    return [f"{name}={v}" for name in KERNEL_SWITCHES
            if name != "AMX" and (v := switch_set(name)) is not None]


def amx_switched_off() -> bool:
    """Whether weights stay out of the AMX buffer in this process (--no-amx, SPECEE_CPP_AMX=0)."""
    return switch_set("AMX") == 0


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", errors="replace") as fh:
            for line in fh:
                if line.startswith(("model name", "Hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def _library() -> tuple[str, str]:
    """(features llama.cpp compiled in and found, build key of the patched wheel)."""
    import llama_cpp

    from .bindings import library_info

    info = library_info()["system_info"]
    # "CPU : SSE3 = 1 | AVX = 1 | ... |" -> "SSE3 AVX ..."
    feats = " ".join(p.split("=")[0].strip().split(":")[-1].strip()
                     for p in info.split("|") if p.strip().endswith("= 1"))
    version = llama_cpp.__version__
    return feats, version.split("+specee.", 1)[1] if "+specee." in version else version


@functools.lru_cache(maxsize=1)
def code_id() -> str:
    """A digest of this package's files (code and shipped bundles): records measured by
    other code (an edit, another commit) are told apart from this code's, with or without
    git."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix != ".pyc"):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def machine(n_threads: int) -> dict:
    """The facts that decide a measurement's speed, as one small JSON-able dict."""
    feats, build = _library()
    # pages: the huge-page policy the weights met (memory.py); it moves a plain token by
    # more than the cost tables' margins (docs/BENCHMARKS.md, "Weights on huge pages")
    thp = thp_mode() or "none"
    return {"cpu": _cpu_name(), "features": feats, "threads": int(n_threads), "build": build,
            "amx": "absent" if "AMX_INT8" not in feats else "off" if amx_switched_off() else "on",
            "pages": thp if huge_pages_wanted() else f"{thp}, off",
            # a switch set by hand moves the price of a token or of verifying a few (row
            # limits by up to a third, the read-ahead by 8-19%: docs/kernels.md), so it is
            # part of the machine; choices measured here are keyed by what they price
            **({"switches": ", ".join(sw)} if (sw := switches_set()) else {})}


def machine_id(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:12]


def describe(m: dict | None) -> str:
    """One line for reports: 'Intel Xeon ... (AVX2 AVX512 ...), 2 threads, build abc, AMX on'."""
    if not m:
        return "machine not recorded"
    return (f"{m.get('cpu', '?')} ({m.get('features', '?')}), {m.get('threads', '?')} threads, "
            f"build {m.get('build', '?')}, AMX {m.get('amx', '?')}"
            + (f", huge pages {m['pages']}" if "pages" in m else "")
            + (f", {m['switches']}" if "switches" in m else ""))

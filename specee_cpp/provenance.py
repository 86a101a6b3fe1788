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

# patch 0003: ggml-cpu leaves weights out of the AMX buffer when this is set to anything but
# "" or "0" (read once, when the CPU backend first lists its buffer types)
NO_AMX_ENV = "GGML_CPU_NO_AMX"


AMX_ROWS_ENV = "GGML_AMX_VNNI_ROWS"   # patch 0009: batches up to this many rows row by row
AMX_ROWS_DEFAULT = 4                  # the patch's value when the variable is unset
# patch 0010: Q4_K/Q6_K batches of up to this many rows several rows at once (unset: every
# batch; 0: none, they go row by row like the other types)
AMX_FUSED_ENV = "GGML_AMX_VNNI_FUSED_ROWS"


# patch 0011: repacked Q4_K weights (x86 with AVX2, weights not in the AMX buffer) take
# batches of 2 up to this many rows several rows at once (unset: 15 in an AVX-512 build
# without VNNI, whose upstream gemm takes 16 rows at a time, and every batch with AVX2 alone
# or AVX-512 VNNI, where patch 0018's kernel beats that gemm; 0 or 1: upstream's gemm and
# one-row gemv)
REPACK_FUSED_ENV = "GGML_REPACK_FUSED_ROWS"
REPACK_FUSED_AVX512 = 15


def repack_fused_default(avx512: bool, vnni: bool = False) -> int | None:
    """Patch 0011's row limit when its variable is unset: None is every batch."""
    return REPACK_FUSED_AVX512 if avx512 and not vnni else None


# patch 0012: Q6_K weights (not repacked on x86) take batches of 2 up to this many rows one
# weight row against all rows at once (unset: 16; 0 or 1: upstream's dot per pair, and its
# tiled matmul from 8 rows)
Q6K_FUSED_ENV = "GGML_Q6_K_FUSED_ROWS"
Q6K_FUSED_DEFAULT = 16


# patch 0015: the x86 matmul kernels ask for the weights this many bytes ahead of the block
# they read (unset: the library's default; 0 or less: off)
PREFETCH_ENV = "GGML_CPU_PREFETCH"


def prefetch_set() -> int | None:
    """Patch 0015's distance where this process's environment sets one (else None), read as
    the patch reads it (atoll: the leading number, anything else 0; 0 or less is off)."""
    raw = os.environ.get(PREFETCH_ENV)
    if raw is None:
        return None
    m = re.match(r"\s*[+-]?\d+", raw)
    return max(int(m.group()), 0) if m else 0


def amx_rows_override() -> int | None:
    """Patch 0009's row limit where this process's environment sets one other than its
    default (else None), read as the patch reads it (a value below 1 is ignored there)."""
    try:
        n = int(os.environ.get(AMX_ROWS_ENV, ""))
    except ValueError:
        return None
    return n if n >= 1 and n != AMX_ROWS_DEFAULT else None


def _leading_int(env: str, default: int | None) -> int | None:
    # as patches 0010-0012 read their limits: the leading digits of a value that starts
    # with one; None where unset, unreadable or the default
    m = re.match(r"\d+", os.environ.get(env, ""))
    return int(m.group()) if m and int(m.group()) != default else None


def amx_fused_override() -> int | None:
    """Patch 0010's row limit where this process's environment sets one (else None), read
    as the patch reads it (its default, every batch, is no number)."""
    return _leading_int(AMX_FUSED_ENV, default=None)


def repack_fused_override() -> int | None:
    """Patch 0011's row limit where this process's environment sets one other than its
    default for the loaded build (else None), read as the patch reads it."""
    feats = _library()[0].split()
    return _leading_int(REPACK_FUSED_ENV, repack_fused_default("AVX512" in feats,
                                                               "AVX512_VNNI" in feats))


def q6k_fused_override() -> int | None:
    """Patch 0012's row limit where this process's environment sets one other than its
    default (else None), read as the patch reads it."""
    return _leading_int(Q6K_FUSED_ENV, Q6K_FUSED_DEFAULT)


def amx_switched_off() -> bool:
    """Whether the AMX switch is off in this process's environment, as the patch reads it."""
    return os.environ.get(NO_AMX_ENV, "") not in ("", "0")


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


def machine(n_threads: int) -> dict:
    """The facts that decide a measurement's speed, as one small JSON-able dict."""
    feats, build = _library()
    # pages: the huge-page policy the weights met (memory.py); it moves a plain token by
    # more than the cost tables' margins (docs/BENCHMARKS.md, "Weights on huge pages")
    thp = thp_mode() or "none"
    return {"cpu": _cpu_name(), "features": feats, "threads": int(n_threads), "build": build,
            "amx": "absent" if "AMX_INT8" not in feats else
            ("off" if amx_switched_off() else _amx_on()),
            "pages": thp if huge_pages_wanted() else f"{thp}, off",
            # a row limit set by hand moves the price of verifying a few tokens (docs/kernels.md,
            # "x86 without AMX"); only then is it part of the machine, so that tables
            # measured before the variables existed keep their key
            **({"rows": ", ".join(limits)} if (limits := row_limits_set()) else {}),
            # the weights' read-ahead set by hand moves a plain token by 8-19% (docs/kernels.md,
            # "Every x86 CPU"); recorded only then, as the row limits are (a model's measured
            # choice is recorded by what it keys: speculative.mode.cost_model)
            **({"prefetch": f"{PREFETCH_ENV}={pf}"} if (pf := prefetch_set()) is not None
               else {})}


def row_limits_set() -> list[str]:
    """Patches 0011/0012's row limits set by hand in this process's environment."""
    return [f"{env}={n}" for env, n in ((REPACK_FUSED_ENV, repack_fused_override()),
                                        (Q6K_FUSED_ENV, q6k_fused_override())) if n is not None]


def _amx_on() -> str:
    # a row limit other than the default is another machine for the cost cache: it moves
    # the price of verifying 2-8 tokens by up to a third (docs/kernels.md)
    rows, fused = amx_rows_override(), amx_fused_override()
    return ", ".join(["on"] + ([f"{AMX_ROWS_ENV}={rows}"] if rows is not None else [])
                     + ([f"{AMX_FUSED_ENV}={fused}"] if fused is not None else []))


def machine_id(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:12]


def describe(m: dict | None) -> str:
    """One line for reports: 'Intel Xeon ... (AVX2 AVX512 ...), 2 threads, build abc, AMX on'."""
    if not m:
        return "machine not recorded"
    return (f"{m.get('cpu', '?')} ({m.get('features', '?')}), {m.get('threads', '?')} threads, "
            f"build {m.get('build', '?')}, AMX {m.get('amx', '?')}"
            + (f", huge pages {m['pages']}" if "pages" in m else "")
            + (f", {m['rows']}" if "rows" in m else "")
            + (f", {m['prefetch']}" if "prefetch" in m else ""))

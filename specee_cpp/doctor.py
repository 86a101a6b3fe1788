"""Diagnostics for `specee-cpp doctor`: rows of (check, result) and an overall ok."""
from __future__ import annotations

import shutil

from . import memory
from .errors import SpeceeError
from .models.pull import is_verified
from .models.registry import load_registry
from .paths import home
from .provenance import (AMX_FUSED_ENV, AMX_ROWS_DEFAULT, AMX_ROWS_ENV, NO_AMX_ENV,
                         PREFETCH_ENV, Q6K_FUSED_DEFAULT, Q6K_FUSED_ENV, REPACK_FUSED_ENV,
                         amx_fused_override, amx_rows_override, amx_switched_off, prefetch_set,
                         q6k_fused_override, repack_fused_default, repack_fused_override)


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", errors="replace") as fh:
            return any(line.startswith("flags") and " amx_int8" in line for line in fh)
    except OSError:
        return False


def amx_state(system_info: str) -> str:
    """Whether llama.cpp's AMX kernels run: compiled in, CPU has them, not switched off."""
    compiled = "AMX_INT8 = 1" in system_info
    if not compiled:
        return ("not compiled in (this CPU has AMX: a native build on it uses AMX)"
                if cpu_has_amx() else "not compiled in (this CPU has no AMX)")
    if amx_switched_off():
        return f"compiled in, off ({NO_AMX_ENV} / --no-amx)"
    rows, fused = amx_rows_override(), amx_fused_override()
    together = ("every batch" if fused is None else "none" if fused < 2
                else f"batches of up to {fused} rows")
    together = (f"Q4_K/Q6_K weights: {together} several rows at once, patch 0010 "
                f"({AMX_FUSED_ENV}=0: off)")
    batches = (f"other types: batches of up to {rows} rows row by row ({AMX_ROWS_ENV})"
               if rows is not None
               else f"other types: batches of 2-{AMX_ROWS_DEFAULT} rows row by row, patch 0009 "
                    f"({AMX_ROWS_ENV}=1: upstream)")
    return f"compiled in, on (turn off with --no-amx or {NO_AMX_ENV}=1); {together}; {batches}"


def repack_state(system_info: str) -> str:
    """How x86 kernels without AMX take a batch of a few rows: repacked Q4_K (patch 0011;
    its AVX2 kernel is patch 0016's where the build lacks AVX-512 VNNI, patch 0018's two-strip
    kernel, for every batch, where it has it) and Q6_K (patch 0012;
    in 512-bit steps in AVX-512 builds, patch 0017, one-row dot included; its scale sums by
    VNNI and small row counts unrolled, patch 0019)."""
    if "AVX2 = 1" not in system_info:
        return "not used (no x86 AVX2 kernels in this build)"

    def rows(override: int | None, default: int | None, patch: str, env: str) -> str:
        limit = default if override is None else override   # None: no limit
        if limit is not None and limit < 2:
            how = "upstream's kernels (none several rows at once)"
        else:
            span = "2 rows or more" if limit is None else f"2-{limit} rows"
            how = f"batches of {span} several rows at once, patch {patch}"
        return f"{how} ({env}=0: upstream)"

    # the switch is named only where its kernel is in the build
    vnni = "AVX512_VNNI = 1" in system_info
    q4k_default = repack_fused_default("AVX512 = 1" in system_info, vnni)
    q4k_patch = ("0011 with 0018's two-strip AVX-512 kernel" if vnni
                 else "0011 with 0016's AVX2 kernel")
    override = repack_fused_override()
    q4k = (rows(override, q4k_default, q4k_patch, REPACK_FUSED_ENV)
           if "REPACK = 1" in system_info else "not repacked in this build")
    # ggml's system info names AVX512 (F) alone; every CPU with it that llama.cpp builds for
    # also has the BW subset patch 0017's kernel is compiled with
    q6k_patch = ("0012 with 0017's AVX-512 kernel" + (", 0019's VNNI sums" if vnni else "")
                 if "AVX512 = 1" in system_info else "0012")
    q6k = rows(q6k_fused_override(), Q6K_FUSED_DEFAULT, q6k_patch, Q6K_FUSED_ENV)
    amx = (" (AMX on: the AMX buffer takes Q4_K and Q6_K, patch 0010; this applies with "
           "--no-amx)" if "AMX_INT8 = 1" in system_info and not amx_switched_off() else "")
    # patch 0020: a draft's repacked IQ4_NL / Q4_0 weights, 2-3 rows (its catch-ups) at once,
    # under the same switch (its C side takes at most 3 rows whatever the limit)
    small = (rows(None if override is None else min(override, 3), 3, "0020", REPACK_FUSED_ENV)
             if "REPACK = 1" in system_info else "not repacked in this build")
    return (f"repacked Q4_K weights: {q4k}; Q6_K weights: {q6k}; repacked IQ4_NL/Q4_0 "
            f"weights: {small}{amx}")


def prefetch_state(system_info: str, distance: int | None) -> str:
    """Whether the x86 matmul kernels ask for the weights ahead (patch 0015), where that
    came from, and what was measured on this machine (engine/read_ahead.py)."""
    if "AVX2 = 1" not in system_info:
        return "not used (no x86 AVX2 kernels in this build)"
    if distance is None:
        return "not in this build (patch 0015 missing)"
    if prefetch_set() is not None:
        return (f"{'off' if distance <= 0 else f'{distance} bytes ahead'}, set by hand "
                f"({PREFETCH_ENV}); unset it to use this machine's measurement")
    from .engine.read_ahead import measured

    seen = measured()
    if not seen:
        return ("off until measured: the first load of a model on this machine times it "
                "on and off and keeps the faster")
    return "; ".join(f"{name}: {'on' if on else 'off'} ({1e3 * t_on:.2f} ms a token with it, "
                     f"{1e3 * t_off:.2f} ms without)" for name, on, t_on, t_off in seen)


def diagnose() -> tuple[list[tuple[str, str]], bool]:
    rows: list[tuple[str, str]] = []
    ok = True
    try:
        from .bindings import cpu_prefetch_bytes, library_info

        info = library_info()
        rows += [
            ("llama-cpp-python", info["llama_cpp_python"]),
            ("libllama", info["library"]),
            ("specee patch", f"present, version {info['specee_patch_version']}"),
            ("GPU offload", "available" if info["gpu_offload"] else
             "not in this build (rebuild with CMAKE_ARGS=-DGGML_CUDA=on, or Metal on macOS)"),
            ("CPU features", info["system_info"]),
            ("AMX", amx_state(info["system_info"])),
            ("CPU repack", repack_state(info["system_info"])),
            ("weight prefetch", prefetch_state(info["system_info"], cpu_prefetch_bytes())),
            ("huge pages", memory.describe()),
        ]
        from .crash_probe import run_probe

        probe = run_probe()
        rows.append(("crash probe", probe.message))
        ok = ok and probe.ok
    except SpeceeError as e:
        rows.append(("specee patch", f"MISSING: {e}"))
        ok = False
    root = home()
    rows.append(("cache", str(root)))
    wheels = sorted((root / "wheels").glob("*/*.whl")) if (root / "wheels").is_dir() else []
    rows.append(("cached wheels", ", ".join(w.parent.name for w in wheels) or "none"))
    reg = load_registry()
    present = [e.name for e in reg.models.values() if is_verified(e)]
    rows.append(("models present", ", ".join(present) or "none (specee-cpp pull --pair default)"))
    if root.exists():
        rows.append(("disk free", f"{shutil.disk_usage(root).free / 2**30:.1f} GiB"))
    return rows, ok

"""Diagnostics for `specee-cpp doctor`: rows of (check, result) and an overall ok."""
from __future__ import annotations

import shutil

from . import memory
from .errors import SpeceeError
from .models.pull import is_verified
from .models.registry import load_registry
from .paths import home
from .provenance import AMX_ENV, SWITCH_ENV, amx_switched_off, switch_set


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
        return f"compiled in, off ({AMX_ENV}=0 / --no-amx)"
    return f"compiled in, on (turn off with --no-amx or {AMX_ENV}=0)"


# what each row-limit switch's kernels take, and the patches that make them
ROW_SWITCHES = {
    "AMX_ROWS": "AMX, types without a multi-row kernel: row by row (0009)",
    "AMX_FUSED_ROWS": "AMX, Q4_K/Q6_K: one-token decodes and rows together (0010)",
    "REPACK_ROWS": "repacked Q4_K: rows together (0015; IQ4_NL/Q4_0 2-3 rows)",
    "Q6_K_ROWS": "Q6_K: each weight row against the rows (0016)",
    "ATTN_ROWS": "flash attention: one-token decodes and batches, each row as alone (0014)",
    "DOT_ROWS": "Q2_K/Q3_K/Q5_K/IQ types: the one-row dot per pair, not the tiled matmul (0014)",
}


def row_kernels(system_info: str, live) -> list[str]:
    """One line per row-limit switch that applies to this build: the batch sizes its kernels
    take now (``live``: name -> value), and where that came from."""
    from .engine.prompt_kernels import EVERY_BATCH, PROMPT_SWITCHES, build_switches, measured

    amx = "AMX_INT8 = 1" in system_info and not amx_switched_off()
    names = build_switches(system_info, amx) + ["ATTN_ROWS", "DOT_ROWS"]   # those: every CPU
    seen = measured()
    lines = []
    for name in names:
        value = live(name)
        if value is None:
            lines.append(f"{name}: not in this build (patch 0014 missing)")
            continue
        span = ("off: upstream's kernels" if value < 2 else
                "every batch" if value >= EVERY_BATCH else f"batches of 2-{value} rows")
        if switch_set(name) is not None:
            source = f"set by hand ({SWITCH_ENV.format(name)})"
        else:
            mine = [f"{model}: {'ours' if ours else 'upstream'} ({t_ours:.2f} s ours, "
                    f"{t_up:.2f} s upstream's, a prompt batch)"
                    for model, sw, ours, t_ours, t_up in seen if sw == name]
            source = ("measured here for prompts: " + "; ".join(mine) if mine else
                      "library default; prompts on upstream's kernels until measured "
                      "(specee-cpp costs)" if name in PROMPT_SWITCHES else "library default")
        lines.append(f"{name} ({ROW_SWITCHES[name]}): {span}, {source}")
    return lines


DECODE_SWITCHES = {"READ_AHEAD": "weight read-ahead", "ONE_ROW": "one-row kernel"}


def decode_kernel_state(system_info: str, name: str, value: int | None) -> str:
    """Whether the one-token decode's x86 kernel switch ``name`` is on (``READ_AHEAD``: the
    weights read ahead, patch 0013; ``ONE_ROW``: repacked Q4_K's rows kernel, 0015), where
    that came from, and what was measured on this machine (engine/decode_kernels.py)."""
    if "AVX2 = 1" not in system_info:
        return "not used (no x86 AVX2 kernels in this build)"
    if value is None:
        return "not in this build (patches 0013-0015 missing)"
    state = "off" if value <= 0 else f"{value} bytes ahead" if name == "READ_AHEAD" else "on"
    if switch_set(name) is not None:
        return (f"{state}, set by hand ({SWITCH_ENV.format(name)}); unset it to use this "
                f"machine's measurement")
    if name == "ONE_ROW" and "AMX_INT8 = 1" in system_info and not amx_switched_off():
        return "not used: AMX decodes the Q4_K weights here"
    from .engine.decode_kernels import measured

    seen = [m for m in measured() if m[1] == name]
    if not seen:
        return ("off until measured: the first load of a model on this machine (in chat and "
                "a server of one request at a time, their first idle time) times it on and off "
                "and keeps the faster")
    return "; ".join(f"{model}: {'on' if on else 'off'} ({1e3 * t_on:.2f} ms a token with it, "
                     f"{1e3 * t_off:.2f} ms without)" for model, _, on, t_on, t_off in seen)


def slots_state() -> str:
    """How many requests serve decodes at once by default, per model timed on this machine
    (engine/slot_step.py)."""
    from .config import SLOT_DEFAULT
    from .engine.slot_step import measured

    seen = measured()
    if not seen:
        return ("not timed yet: serve times a step of several requests on a model's first "
                "start here and runs slots where it pays")
    return "; ".join(f"{name}: {n} (a step of {SLOT_DEFAULT} requests gives {g:.1f}x the "
                     f"tokens a second of one at a time)" for name, n, g in seen)


def diagnose() -> tuple[list[tuple[str, str]], bool]:
    rows: list[tuple[str, str]] = []
    ok = True
    try:
        from .bindings import kernel_switch, library_info

        info = library_info()
        rows += [
            ("llama-cpp-python", info["llama_cpp_python"]),
            ("libllama", info["library"]),
            ("specee patch", f"present, version {info['specee_patch_version']}"),
            ("GPU offload", "available" if info["gpu_offload"] else
             "not in this build (rebuild with CMAKE_ARGS=-DGGML_CUDA=on, or Metal on macOS)"),
            ("CPU features", info["system_info"]),
            ("AMX", amx_state(info["system_info"])),
            *(("row kernels", line) for line in row_kernels(info["system_info"], kernel_switch)),
            *((what, decode_kernel_state(info["system_info"], name, kernel_switch(name)))
              for name, what in DECODE_SWITCHES.items()),
            ("huge pages", memory.describe()),
            ("server slots", slots_state()),
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

"""Diagnostics for `specee-cpp doctor`: rows of (check, result) and an overall ok."""
from __future__ import annotations

import shutil

from .errors import SpeceeError
from .models.pull import is_verified
from .models.registry import load_registry
from .paths import home


def diagnose() -> tuple[list[tuple[str, str]], bool]:
    rows: list[tuple[str, str]] = []
    ok = True
    try:
        from .bindings import library_info

        info = library_info()
        rows += [
            ("llama-cpp-python", info["llama_cpp_python"]),
            ("libllama", info["library"]),
            ("specee patch", f"present, version {info['specee_patch_version']}"),
            ("GPU offload", "available" if info["gpu_offload"] else
             "not in this build (rebuild with CMAKE_ARGS=-DGGML_CUDA=on, or Metal on macOS)"),
            ("CPU features", info["system_info"]),
        ]
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

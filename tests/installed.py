"""The installed llama_cpp package's shared libraries (the patched wheel's), for the tests
that disassemble or call them directly."""
from __future__ import annotations

from pathlib import Path


def installed_lib(name: str) -> Path | None:
    """The package's library whose file name contains ``name`` (``libggml-cpu.so`` on Linux,
    ``.dylib`` on macOS, ``ggml-cpu.dll`` on Windows), or None."""
    import llama_cpp

    found = sorted(p for p in (Path(llama_cpp.__file__).parent / "lib").glob(f"*{name}*")
                   if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name)
    return found[0] if found else None

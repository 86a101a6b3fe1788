"""The repository's scripts/ (plain files, not a package) for the tests: one loaded as a
fresh module, or the folder importable for the length of a ``with`` block (for the scripts
that import each other by name)."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@contextlib.contextmanager
def scripts_on_path():
    """scripts/ first on sys.path while the block imports; removed after it."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield
    finally:
        sys.path.remove(str(SCRIPTS))


def load_script(name: str):
    """scripts/NAME.py run as a fresh module of its own (not put in sys.modules): a test may
    change its globals without touching another test's copy."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

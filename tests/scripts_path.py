"""The repository's scripts/ (plain files that import each other by name, not a package),
importable from tests for the length of a ``with`` block."""
from __future__ import annotations

import contextlib
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

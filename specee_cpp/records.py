"""JSON-lines files, the one reader: benchmark records, profile rounds, prompt sets.

Writers append one record per line and flush, so a killed run leaves at most one torn
line, at the end; readers that resume such a run drop that line (``torn_tail``) and refuse
a bad line anywhere else, naming its place.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SpeceeError


def read_jsonl(path: Path, *, what: str = "JSONL file", missing_ok: bool = False,
               torn_tail: bool = False) -> list[tuple[int, Any]]:
    """(line number, record) for every non-blank line of ``path``."""
    path = Path(path)
    if not path.is_file():
        if missing_ok:
            return []
        raise SpeceeError(f"{what} not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except ValueError:
            if torn_tail and i == len(lines):
                break
            raise SpeceeError(f"{path}:{i}: not a JSON record; fix or remove that line") from None
    return out


def records(path: Path, **kw) -> list[Any]:
    """The records of :func:`read_jsonl`, without line numbers."""
    return [rec for _, rec in read_jsonl(path, **kw)]

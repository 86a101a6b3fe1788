"""Shared by the benchmark scripts: replace (or append) one section of docs/BENCHMARKS.md."""
from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def write_section(heading: str, body: str, path: Path = BENCHMARKS) -> None:
    """Write ``## heading`` + body into docs/BENCHMARKS.md, replacing that section."""
    from specee_cpp.bench.report import write_section as write

    write(path, heading, body)


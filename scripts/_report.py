"""Shared by the benchmark scripts: replace (or append) one section of docs/BENCHMARKS.md."""
from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


TAG_HELP = ("a name for this machine: its table goes into a BENCHMARKS.md section of that "
            "name (and its raw JSON into a file of that name)")


def tagged(name: str, tag: str) -> str:
    """A section heading named for one machine where ``tag`` is given. Untagged, a run on
    another machine than the section's still does not replace it (write_section puts it
    beside, under a heading of the CPU's name); the tag chooses the name."""
    return f"{name} ({tag})" if tag else name


def tagged_file(stem: str, tag: str, suffix: str = ".json") -> str:
    """A raw-output file name kept apart per machine the same way: ``stem-tag.json``."""
    return f"{stem}-{tag}{suffix}" if tag else f"{stem}{suffix}"


def write_section(heading: str, body: str, path: Path = BENCHMARKS) -> str:
    """Write ``## heading`` + body into docs/BENCHMARKS.md, replacing that section where it
    was measured on this machine (else beside it, under a tagged heading: said on stdout)."""
    from specee_cpp.bench.report import write_section as write

    written = write(path, heading, body)
    if written != heading:
        print(f"{path.name}: '{heading}' holds another machine's table; wrote '{written}'")
    return written


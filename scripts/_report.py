"""Shared by the benchmark scripts: replace (or append) one section of docs/BENCHMARKS.md."""
from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def write_section(heading: str, body: str, path: Path = BENCHMARKS) -> None:
    """Write ``## heading`` + body into docs/BENCHMARKS.md, replacing that section."""
    from specee_cpp.bench.report import write_section as write

    write(path, heading, body)


def ee_configs(spec: str) -> dict:
    """Named decoding configurations of the early-exit benchmarks, as (mode, EEConfig), for a
    comma-separated selection; an unknown name stops with the valid ones."""
    from specee_cpp.config import EEConfig

    known = {"plain": ("plain", EEConfig()),
             "ee-draft": ("ee", EEConfig(provider="draft")),
             "ee-ngram": ("ee", EEConfig(provider="ngram")),
             "ee-draft-cand": ("ee", EEConfig(provider="draft", rule="candidate")),
             "ee-ngram-cand": ("ee", EEConfig(provider="ngram", rule="candidate"))}
    names = spec.split(",")
    for n in names:
        if n not in known:
            raise SystemExit(f"unknown config {n!r}; valid: {', '.join(known)}")
    return {n: known[n] for n in names}

"""Where specee-cpp keeps its files: ``$SPECEE_CPP_HOME``, default ``~/.cache/specee-cpp``."""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Root of the cache (models, built wheels); created on first use by whoever writes."""
    env = os.environ.get("SPECEE_CPP_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specee-cpp"


def models_dir() -> Path:
    return home() / "models"


# fitted files shipped inside the package: exit predictors and draft-length controllers
BUNDLE_DIR = Path(__file__).resolve().parent / "bundles"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it (named
    by this process, so that two writers of one cache file do not share it), then renamed
    over it. An interrupted write leaves the old file, or none, never a torn one that the
    next reader has to detect."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

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

"""Shared fixtures: tiny GGUFs (written per session) and the real small model (via pull)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import write_tiny_model  # noqa: E402

SMALL_MODEL = "smollm2-135m"
# Big downloads and builds are shared with the user's cache; everything a test run computes
# (calibration records, cost models, quantized variants) goes to a fresh home per session,
# so that a cached result never stands in for code under test.
_SHARED = ("cpu-variants", "models", "sdist", "tools", "wheels")


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory):
    from specee_cpp.paths import home as real_home

    real = real_home()
    home = tmp_path_factory.mktemp("specee-home")
    for name in _SHARED:
        (real / name).mkdir(parents=True, exist_ok=True)
        try:
            (home / name).symlink_to(real / name, target_is_directory=True)
        except OSError:  # no symlinks (Windows without the privilege): fetch again there
            pass
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECEE_CPP_HOME", str(home))
    yield home
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def gpu_layers_for_tests():
    """SPECEE_CPP_TEST_GPU_LAYERS=-1 (scripts/gpu_check.py on a GPU machine): every model a
    test loads is offloaded, unless the test asks for a layer count itself."""
    n = int(os.environ.get("SPECEE_CPP_TEST_GPU_LAYERS", "0") or 0)
    if not n:
        yield
        return
    from specee_cpp.bindings.llama import Model

    init = Model.__init__
    defaults = init.__defaults__
    init.__defaults__ = (n,) + defaults[1:]
    yield
    init.__defaults__ = defaults


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-llama.gguf", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-qwen2.gguf", arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_other_vocab(tiny_dir) -> Path:
    """Same architecture as tiny_llama, different vocabulary."""
    return write_tiny_model(tiny_dir / "tiny-other-vocab.gguf", extra_words=["▁extra"], seed=2)


@pytest.fixture(scope="session")
def tiny_unknown_arch(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-unknown.gguf", arch="notanarch")


@pytest.fixture(scope="session")
def small_model() -> Path:
    """SmolLM2-135M obtained through `pull` itself (idempotent: instant once verified)."""
    from specee_cpp.models.pull import pull
    from specee_cpp.models.registry import load_registry

    return pull(load_registry().get(SMALL_MODEL))


@pytest.fixture(scope="session")
def small_llm(small_model):
    from specee_cpp.engine.llm import LLM
    from specee_cpp.config import LoadConfig

    llm = LLM(small_model, config=LoadConfig(n_ctx=1024, n_threads=2))
    yield llm
    llm.close()

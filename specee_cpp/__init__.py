"""specee-cpp: fast local LLM decoding on a patched llama.cpp.

Public API (imported lazily, so that `specee-cpp pull` or `models` work without loading
libllama)::

    import specee_cpp
    llm = specee_cpp.load("qwen2.5-coder-1.5b")         # registry name or path to a .gguf
    for step in llm.stream("Write a haiku", max_tokens=64):
        print(step.text, end="", flush=True)
    llm.generate("Sort a list in Python", mode="spec", gamma=4)   # a mode and its options

Decoding modes register themselves (``engine/modes.py``) when their module is imported;
this is the one place that imports the built-in ones (every module of the package runs
this first), which loads no library.
"""
from __future__ import annotations

from .engine import plain as _plain  # noqa: F401, I001  (registers mode plain, first)
from .speculative import mode as _spec_mode  # noqa: F401  (registers mode spec)
from .early_exit import mode as _ee_mode  # noqa: F401  (registers mode ee)
from .spec_ee import mode as _spec_ee_mode  # noqa: F401  (registers mode spec-ee)

__version__ = "0.1.0"

_LAZY = {
    "load": ("specee_cpp.engine.llm", "load"),
    "LLM": ("specee_cpp.engine.llm", "LLM"),
    "Step": ("specee_cpp.engine.steps", "Step"),
    "Stats": ("specee_cpp.engine.steps", "Stats"),
    "SamplingConfig": ("specee_cpp.config", "SamplingConfig"),
    "SpecOptions": ("specee_cpp.speculative.mode", "SpecOptions"),
    "EEOptions": ("specee_cpp.early_exit.mode", "EEOptions"),
    "SpecEEOptions": ("specee_cpp.spec_ee.mode", "SpecEEOptions"),
    "modes": ("specee_cpp.engine", "modes"),
    "LoadConfig": ("specee_cpp.config", "LoadConfig"),
    "SpeceeError": ("specee_cpp.errors", "SpeceeError"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specee_cpp' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)

"""Raw ctypes declarations of the specee-cpp patch's C API (see patches/).

The stock llama.cpp API is declared by ``llama_cpp.llama_cpp``; this module adds ours on the
same library handle and refuses, at import, a libllama that lacks them.
"""
from __future__ import annotations

import ctypes

from ..errors import LibraryError

# The patch-set version this package needs; bump together with llama_specee_patch_version().
REQUIRED_PATCH_VERSION = 1
BUILD_HINT = "build and install the patched wheel with: python scripts/bootstrap.py setup"

try:
    from llama_cpp import llama_cpp as ll
except (ImportError, OSError, RuntimeError) as e:  # missing package or unloadable libllama
    raise LibraryError(f"cannot load llama-cpp-python ({e}); {BUILD_HINT}") from None

lib = ll._lib
lib_path = getattr(lib, "_name", "?")


def _bind(name: str, argtypes: list, restype):
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise LibraryError(
            f"{lib_path} is not the specee-cpp patched libllama (no symbol {name}); {BUILD_HINT}"
        ) from None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


# int32_t llama_specee_patch_version(void);
llama_specee_patch_version = _bind("llama_specee_patch_version", [], ctypes.c_int32)

# int32_t llama_specee_set_layer_inp(struct llama_context * ctx, int32_t il, bool enable);
llama_specee_set_layer_inp = _bind(
    "llama_specee_set_layer_inp", [ll.llama_context_p_ctypes, ctypes.c_int32, ctypes.c_bool],
    ctypes.c_int32)

# float * llama_specee_get_layer_inp(struct llama_context * ctx, int32_t il);
llama_specee_get_layer_inp = _bind(
    "llama_specee_get_layer_inp", [ll.llama_context_p_ctypes, ctypes.c_int32],
    ctypes.POINTER(ctypes.c_float))

PATCH_VERSION = llama_specee_patch_version()
if PATCH_VERSION < REQUIRED_PATCH_VERSION:
    raise LibraryError(f"{lib_path} has specee-cpp patch version {PATCH_VERSION}, this package "
                       f"needs {REQUIRED_PATCH_VERSION}; {BUILD_HINT}")

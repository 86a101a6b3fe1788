"""Raw ctypes declarations of the specee-cpp patch's C API (see patches/).

The stock llama.cpp API is declared by ``llama_cpp.llama_cpp``; this module adds ours on the
same library handle and refuses, at import, a libllama that lacks them.
"""
from __future__ import annotations

import ctypes
import functools

from ..errors import LibraryError

# The patch-set version this package needs; bump together with llama_specee_patch_version().
REQUIRED_PATCH_VERSION = 10
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

# an older patched build lacks later symbols: say which version it is, before binding them
PATCH_VERSION = llama_specee_patch_version()
if PATCH_VERSION < REQUIRED_PATCH_VERSION:
    raise LibraryError(f"{lib_path} has specee-cpp patch version {PATCH_VERSION}, this package "
                       f"needs {REQUIRED_PATCH_VERSION}; {BUILD_HINT}")

# bool llama_specee_arch_supported(const char * name);
llama_specee_arch_supported = _bind("llama_specee_arch_supported", [ctypes.c_char_p],
                                    ctypes.c_bool)

# int32_t llama_specee_argmax(struct llama_context * ctx, int32_t i);
llama_specee_argmax = _bind("llama_specee_argmax", [ll.llama_context_p_ctypes, ctypes.c_int32],
                            ctypes.c_int32)

# bool llama_specee_seq_cells(struct llama_context * ctx, uint32_t n_cells);
llama_specee_seq_cells = _bind("llama_specee_seq_cells",
                               [ll.llama_context_p_ctypes, ctypes.c_uint32], ctypes.c_bool)

# int32_t llama_specee_confidence(struct llama_context * ctx, int32_t i, float * top1,
#                                 float * entropy);
llama_specee_confidence = _bind(
    "llama_specee_confidence", [ll.llama_context_p_ctypes, ctypes.c_int32,
                                ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float)],
    ctypes.c_int32)

# int32_t llama_specee_head_n(const struct llama_model * model);
llama_specee_head_n = _bind("llama_specee_head_n", [ll.llama_model_p_ctypes], ctypes.c_int32)

# int32_t llama_specee_set_layer_inp(struct llama_context * ctx, int32_t il, bool enable);
llama_specee_set_layer_inp = _bind(
    "llama_specee_set_layer_inp", [ll.llama_context_p_ctypes, ctypes.c_int32, ctypes.c_bool],
    ctypes.c_int32)

# float * llama_specee_get_layer_inp(struct llama_context * ctx, int32_t il);
llama_specee_get_layer_inp = _bind(
    "llama_specee_get_layer_inp", [ll.llama_context_p_ctypes, ctypes.c_int32],
    ctypes.POINTER(ctypes.c_float))

_ctx_p = ll.llama_context_p_ctypes

# int32_t llama_specee_stage_begin(struct llama_context * ctx, struct llama_batch batch);
llama_specee_stage_begin = _bind("llama_specee_stage_begin", [_ctx_p, ll.llama_batch],
                                 ctypes.c_int32)

# int32_t llama_specee_stage_run(struct llama_context * ctx, int32_t il_end,
#                                const llama_token * cand, int32_t n_cand, float * out_probe);
llama_specee_stage_run = _bind(
    "llama_specee_stage_run",
    [_ctx_p, ctypes.c_int32, ctypes.POINTER(ll.llama_token), ctypes.c_int32,
     ctypes.POINTER(ctypes.c_float)],
    ctypes.c_int32)

# int32_t llama_specee_stage_head(struct llama_context * ctx);
llama_specee_stage_head = _bind("llama_specee_stage_head", [_ctx_p], ctypes.c_int32)

# int32_t llama_specee_stage_exit(struct llama_context * ctx, bool full_head);
llama_specee_stage_exit = _bind("llama_specee_stage_exit", [_ctx_p, ctypes.c_bool],
                                ctypes.c_int32)

# void llama_specee_stage_abort(struct llama_context * ctx);
llama_specee_stage_abort = _bind("llama_specee_stage_abort", [_ctx_p], None)

# int32_t llama_specee_stage_layer(const struct llama_context * ctx);
llama_specee_stage_layer = _bind("llama_specee_stage_layer", [_ctx_p], ctypes.c_int32)

# float * llama_specee_stage_hidden(struct llama_context * ctx);
llama_specee_stage_hidden = _bind("llama_specee_stage_hidden", [_ctx_p],
                                  ctypes.POINTER(ctypes.c_float))

# size_t llama_specee_stage_bytes(const struct llama_context * ctx);
llama_specee_stage_bytes = _bind("llama_specee_stage_bytes", [_ctx_p], ctypes.c_size_t)


# The CPU backend's thread pool (ggml-cpu.h; not declared by llama-cpp-python). Without one
# attached, every graph compute makes a disposable pool: under OpenMP a small allocation, in
# a build without OpenMP (macOS clang, say) n_threads - 1 new threads per decode.
_GGML_MAX_N_THREADS = 512


class ggml_threadpool_params(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * _GGML_MAX_N_THREADS), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


@functools.cache
def ggml_cpu():
    """(ggml_threadpool_params_default, ggml_threadpool_new), looked up on first use (only
    SPECEE_CPP_THREADPOOL=1 asks); None where the CPU backend is not a library of its own
    (a build with dynamically loaded backend variants)."""
    import pathlib

    from llama_cpp._ctypes_extensions import load_shared_library

    base = pathlib.Path(ll.__file__).parent / "lib"
    try:
        ggml = load_shared_library("ggml-base", base)
        cpu = load_shared_library("ggml-cpu", base)
        default, new = ggml.ggml_threadpool_params_default, cpu.ggml_threadpool_new
    except (OSError, FileNotFoundError, RuntimeError, AttributeError):
        return None
    default.argtypes, default.restype = [ctypes.c_int], ggml_threadpool_params
    new.argtypes, new.restype = [ctypes.POINTER(ggml_threadpool_params)], ctypes.c_void_p
    return default, new


# void llama_attach_threadpool(struct llama_context * ctx, ggml_threadpool_t threadpool,
#                              ggml_threadpool_t threadpool_batch);
llama_attach_threadpool = _bind("llama_attach_threadpool", [_ctx_p, ctypes.c_void_p,
                                                            ctypes.c_void_p], None)

# void llama_detach_threadpool(struct llama_context * ctx);
llama_detach_threadpool = _bind("llama_detach_threadpool", [_ctx_p], None)


def _optional(name: str, argtypes: list, restype):
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


# The CPU kernel switches (ggml-cpu.h, patch 0014), reached through libllama's handle (the CPU
# backend is one of its libraries); None where the CPU backend is loaded at run time instead.
# bool ggml_cpu_specee_set(const char * name, int64_t value);
ggml_cpu_specee_set = _optional("ggml_cpu_specee_set", [ctypes.c_char_p, ctypes.c_int64],
                                ctypes.c_bool)
# int64_t ggml_cpu_specee_get(const char * name);
ggml_cpu_specee_get = _optional("ggml_cpu_specee_get", [ctypes.c_char_p], ctypes.c_int64)
# void ggml_cpu_init(void): reads SPECEE_CPP_<name> for each switch, once
ggml_cpu_init = _optional("ggml_cpu_init", [], None)


# the OpenMP runtimes a CPU backend may have loaded (GNU, LLVM, Intel), by file name
_OPENMP_LIBS = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so", "libgomp.1.dylib",
                "libomp.dylib")


def release_openmp_threads() -> bool:
    """Give back the calling thread's OpenMP thread team (``omp_pause_resource_all``), where
    the CPU backend runs on an OpenMP runtime already loaded; whether one was released.

    Each thread that runs a decode keeps a team of its own, and where the teams' threads
    outnumber the cores, libgomp stops spinning at its barriers and every decode of the
    process slows. A thread that decoded and will not again (a server's main thread, done
    measuring) calls this; a later decode there makes a new team."""
    import os

    mode = getattr(os, "RTLD_NOLOAD", None)
    if mode is None:       # Windows: its OpenMP has no pause; nothing to look up
        return False
    for name in _OPENMP_LIBS:
        try:
            lib = ctypes.CDLL(name, mode=mode | os.RTLD_LAZY)   # only if already loaded
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(1) == 0     # omp_pause_soft: the threads go, the runtime stays
    return False

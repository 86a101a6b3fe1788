"""Owning wrappers over libllama: Model, Context, Batch.

Each wrapper owns one C object and frees it in ``close()`` (also on garbage collection).
Status codes become exceptions here, once, with the offending value; llama.cpp's log is
kept in a ring buffer so that a failed load can say why instead of printing pages of log.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import os
import sys
from pathlib import Path

import numpy as np

from ..errors import (ContextOverflowError, DecodeError, ModelFileError, SpeceeError,
                      UnsupportedArchitectureError)
from ..models.gguf_info import GGUFInfo, read_gguf_info
from ..text import utf8
from . import _ffi
from ._ffi import ll

_LOG: collections.deque[str] = collections.deque(maxlen=64)
_VERBOSE = os.environ.get("SPECEE_CPP_VERBOSE", "") not in ("", "0")
_GGML_LOG_LEVEL_ERROR = 4
_LOAD_MODE_NONE = 0  # enum llama_load_mode: read the file into buffers, no mapping


@ll.llama_log_callback
def _on_log(level: int, text: bytes, user_data) -> None:
    msg = text.decode("utf-8", errors="replace") if text else ""
    _LOG.append(msg)
    if _VERBOSE or level == _GGML_LOG_LEVEL_ERROR and os.environ.get("SPECEE_CPP_LOG_ERRORS"):
        sys.stderr.write(msg)


ll.llama_log_set(_on_log, ctypes.c_void_p(0))
ll.llama_backend_init()


def _last_error() -> str:
    lines = [ln.strip() for ln in "".join(_LOG).splitlines() if ln.strip()]
    # llama.cpp logs the loader's reason ("error loading model: ...") before a generic
    # "failed to load model": the reason is what the user needs
    reason = [ln for ln in lines if "error loading model:" in ln]
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return (reason or errors or lines or ["no log"])[-1]


def library_info() -> dict:
    """Facts about the loaded libllama, for `doctor`."""
    import llama_cpp

    return {
        "llama_cpp_python": llama_cpp.__version__,
        "library": _ffi.lib_path,
        "specee_patch_version": _ffi.PATCH_VERSION,
        "gpu_offload": bool(ll.llama_supports_gpu_offload()),
        "system_info": ll.llama_print_system_info().decode(errors="replace").strip(),
    }


def library_file(name: str) -> Path | None:
    """The llama.cpp shared library whose file name contains ``name`` (``ggml-cpu``,
    ``ggml-base``): the copy this process has mapped where that can be read (Linux's
    /proc/self/maps), else the first such file beside libllama (``.so``, ``.dylib``,
    ``.dll``). The wheel ships each library as three copies (``.so``, ``.so.0``,
    ``.so.0.25.3``): opening another name than the one libllama was linked with maps a second
    copy, whose variables no decode reads."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            paths = {f[5].strip() for f in (line.split(None, 5) for line in fh) if len(f) == 6}
        mapped = sorted(Path(p) for p in paths if p.startswith("/") and name in Path(p).name)
    except OSError:
        mapped = []
    if mapped:
        return mapped[0]
    beside = sorted(p for p in Path(_ffi.lib_path).parent.glob(f"*{name}*")
                    if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name)
    return beside[0] if beside else None


# The CPU kernel switches the patches add (ggml-cpu-impl.h says what each does). Each is an
# integer, 0 meaning off (upstream's kernel); SPECEE_CPP_<name> sets one when the library
# starts, set_kernel_switch between decodes. The library holds the defaults.
KERNEL_SWITCHES = ("AMX", "AMX_ROWS", "AMX_FUSED_ROWS", "REPACK_ROWS", "Q6_K_ROWS", "READ_AHEAD",
                   "ATTN_ROWS", "DOT_ROWS", "ONE_ROW")


@functools.lru_cache(maxsize=1)
def _switches() -> bool:
    """Whether the loaded library has the switches (they are read from the environment on
    the first call of ggml_cpu_init; a later call does nothing)."""
    if _ffi.ggml_cpu_specee_get is None or _ffi.ggml_cpu_init is None:
        return False
    _ffi.ggml_cpu_init()
    return True


def _switch_name(name: str) -> bytes:
    if name not in KERNEL_SWITCHES:
        raise SpeceeError(f"unknown kernel switch {name!r} (known: {', '.join(KERNEL_SWITCHES)})")
    return name.encode()


def kernel_switch(name: str) -> int | None:
    """The value the CPU kernels run with now for switch ``name`` (0: off), or None where the
    loaded library has no such switches."""
    key = _switch_name(name)
    return int(_ffi.ggml_cpu_specee_get(key)) if _switches() else None


def set_kernel_switch(name: str, value: int) -> None:
    """Set switch ``name`` for the decodes that follow (not while one runs: decodes here are
    synchronous). Raises SpeceeError where the library has none or the value is negative."""
    key = _switch_name(name)
    if not _switches():
        raise SpeceeError(f"the CPU backend of {_ffi.lib_path} has no kernel switches")
    if not _ffi.ggml_cpu_specee_set(key, int(value)):   # the library refuses a negative one
        raise SpeceeError(f"kernel switch {name}: {value} is not a value (0 or more)")


class _Handle:
    """A native pointer held by a Model or Context. Once its owner is closed it raises
    instead of handing llama.cpp a NULL or freed pointer: a call through a closed model
    (a script that used the pair after its ``with`` block) was a segfault, not an error."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        value = obj.__dict__.get(self.slot)
        if value is None:
            raise SpeceeError(f"{obj.what} is closed (its {self.name} is freed); use it "
                              f"inside its `with` block or before close()")
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


class Model:
    """A loaded GGUF model (weights + vocabulary)."""

    ptr = _Handle()
    vocab = _Handle()

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, use_extra_bufts: bool = True,
                 use_mmap: bool = True, info: GGUFInfo | None = None):
        self.path = Path(path)
        self.what = f"model {self.path.name}"
        # a clear error before llama.cpp sees the file (``info``: read_gguf_info's, just taken)
        self.info: GGUFInfo = info if info is not None else read_gguf_info(self.path)
        if not _ffi.llama_specee_arch_supported(self.info.arch.encode()):
            raise UnsupportedArchitectureError(
                f"architecture {self.info.arch!r} of {self.path} is not supported by this "
                f"llama.cpp build")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # extra CPU buffer types (AMX, CPU_REPACK) hold weights in layouts for the fast
        # kernels; off, every weight stays in a plain buffer (the reference for tests)
        params.use_extra_bufts = use_extra_bufts
        # mapped: llama.cpp's choice (it falls back to reading where a device cannot map);
        # not mapped: the weights are read into buffers the patched ggml puts on huge pages
        # (memory.py says when that is chosen)
        if not use_mmap:
            params.load_mode = _LOAD_MODE_NONE
        _LOG.clear()
        ptr = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelFileError(f"llama.cpp could not load {self.path}: {_last_error()}")
        self.ptr = ptr
        self.vocab = ll.llama_model_get_vocab(ptr)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(ll.llama_model_n_layer(ptr))
        self.n_embd = int(ll.llama_model_n_embd(ptr))
        # rows of a reduced-vocabulary LM head (models/head.py), 0 for a full head; logits
        # still span n_vocab (-inf where the head has no row)
        self.n_head = int(_ffi.llama_specee_head_n(ptr))

    def close(self) -> None:
        if self.__dict__.get("_ptr"):
            ll.llama_model_free(self._ptr)
        self._ptr = self._vocab = None

    __del__ = close

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 of the GGUF file (pull's stamp when the file is unchanged since), computed
        once: it keys shipped predictor bundles, controllers and cost caches."""
        from ..models.pull import file_sha256

        return file_sha256(self.path)

    @property
    def chat_template(self) -> str | None:
        t = ll.llama_model_chat_template(self.ptr, None)
        return t.decode("utf-8", errors="replace") if t else None

    def token_text(self, token: int) -> str:
        """The text of a single token with special tokens rendered (for chat templates)."""
        return self.token_to_piece(token, special=True).decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> list[int]:
        data = utf8(text)   # refused with the position where it is not text
        n_max = len(data) + 8
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (ll.llama_token * n_max)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special,
                                  parse_special)
        if n < 0:
            raise SpeceeError(f"tokenization failed ({n}) for text of {len(data)} bytes")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise SpeceeError(f"token id {token} out of range [0, {self.n_vocab})")
        # a buffer per call: several threads (the server's slots) detokenize at once
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token of the vocabulary (a pass over it, ~0.1 s once):
        for code that must test tokens after the model is closed (replays)."""
        return frozenset(t for t in range(self.n_vocab) if self.is_eog(t))

    @property
    def bits_per_weight(self) -> float:
        """File bits per parameter: the compression level a draft-length controller sees
        (Q8_0 ~8.5, Q4_K_M ~4.9, IQ4_NL ~4.5, Q3_K_M ~3.9, Q2_K ~3.2 for Qwen2.5)."""
        return 8.0 * ll.llama_model_size(self.ptr) / max(ll.llama_model_n_params(self.ptr), 1)

    @property
    def bos(self) -> int:
        return int(ll.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(ll.llama_vocab_eos(self.vocab))


class Batch:
    """A token batch, reusable across decodes: one sequence's tokens (``set``), or rows of
    several sequences (``set_rows``)."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.raw = ll.llama_batch_init(n_max, 0, 1)

    def set(self, tokens: list[int], pos0: int, output_last_only: bool = True,
            seq_id: int = 0) -> None:
        """Fill with ``tokens`` at positions pos0.. of sequence ``seq_id``; logits for the
        last token or for all."""
        n = len(tokens)
        self.set_rows([(t, pos0 + i, seq_id, (i == n - 1) or not output_last_only)
                       for i, t in enumerate(tokens)])

    def set_rows(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """Fill with ``rows`` of (token, position, sequence id, logits wanted)."""
        n = len(rows)
        if not 0 < n <= self.n_max:
            raise SpeceeError(f"batch of {n} tokens, capacity {self.n_max}")
        b = self.raw
        b.n_tokens = n
        for i, (t, pos, seq, out) in enumerate(rows):
            b.token[i] = t
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out

    def rows(self) -> list[tuple[int, int, int, bool]]:
        """The rows it holds, as ``set_rows`` takes them."""
        b = self.raw
        return [(b.token[i], b.pos[i], b.seq_id[i][0], bool(b.logits[i]))
                for i in range(b.n_tokens)]

    def close(self) -> None:
        if getattr(self, "raw", None) is not None:
            ll.llama_batch_free(self.raw)
            self.raw = None

    __del__ = close


STAGED_ARCHS = ("llama", "qwen2")
_GGML_TYPE_F32 = 0
_FLASH_ATTN_DISABLED = 0   # llama_flash_attn_type
_FLASH_ATTN_ENABLED = 1


_POOLS: dict[int, int] = {}


def shared_threadpool(n_threads: int) -> int | None:
    """With SPECEE_CPP_THREADPOOL=1: one CPU thread pool per thread count for the whole
    process, attached to every context (kept for the life of the process, since contexts
    may still hold it). Off by default, as measured:
    under OpenMP both contexts already run on the one OpenMP team and the pool changed
    nothing beyond noise; in a build without OpenMP ggml's persistent pool made a target
    token 1.7x slower than a pool per decode on our 2-core machine. None where the CPU
    backend's pool API is not reachable."""
    if os.environ.get("SPECEE_CPP_THREADPOOL", "0") != "1" or _ffi.ggml_cpu() is None:
        return None
    if n_threads not in _POOLS:
        default, new = _ffi.ggml_cpu()
        params = default(n_threads)
        pool = new(ctypes.byref(params))
        if not pool:
            return None
        _POOLS[n_threads] = pool
    return _POOLS[n_threads]


class Context:
    """An inference context (KV cache + compute buffers) on a Model.

    ``exact=True`` keeps the KV cache in F32 and turns flash attention off, so that tests
    can compare against a float64 numpy reference tightly; it is slower and not for use.
    """

    ptr = _Handle()
    mem = _Handle()

    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_threads: int,
                 exact: bool = False, n_seq_max: int = 1, kv_unified: bool | None = None,
                 flash_attn: bool | None = None):
        self.what = f"a context on {model.what}"
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seq_max
        if kv_unified is not None:
            params.kv_unified = kv_unified
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        if flash_attn is not None:   # None: llama.cpp's default (auto: on where supported)
            params.flash_attn_type = _FLASH_ATTN_ENABLED if flash_attn else _FLASH_ATTN_DISABLED
        if exact:
            params.type_k = params.type_v = _GGML_TYPE_F32
            params.flash_attn_type = _FLASH_ATTN_DISABLED
        _LOG.clear()
        ptr = ll.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise SpeceeError(f"could not create a context (n_ctx={n_ctx}): {_last_error()}")
        self.ptr = ptr
        self.model = model
        self.flash_attn = False if exact else flash_attn   # as asked (None: llama.cpp's default)
        self.threadpool = shared_threadpool(n_threads)
        if self.threadpool:
            _ffi.llama_attach_threadpool(ptr, self.threadpool, self.threadpool)
        self.n_ctx = int(ll.llama_n_ctx(ptr))
        self.n_batch = n_batch
        self.mem = ll.llama_get_memory(ptr)
        self._stage_n_tokens = 0

    def close(self) -> None:
        if self.__dict__.get("_ptr"):
            ll.llama_free(self._ptr)
        self._ptr = self._mem = None

    __del__ = close

    def decode(self, batch: Batch) -> None:
        rc = ll.llama_decode(self.ptr, batch.raw)
        if rc == 1:
            raise ContextOverflowError(f"no KV cache slot for {batch.raw.n_tokens} tokens "
                                       f"(n_ctx {self.n_ctx}); use a larger --n-ctx")
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc}: {_last_error()}")

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits of output ``i`` of the last decode (-1: the last output)."""
        ptr = ll.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise DecodeError(f"no logits for output {i}: {_last_error()}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def argmax(self, i: int = -1) -> int:
        """The greedy token of output ``i`` of the last decode, chosen in C (no copy of the
        n_vocab logits; the first id on ties, as numpy's argmax)."""
        tok = _ffi.llama_specee_argmax(self.ptr, i)
        if tok < 0:
            raise DecodeError(f"no logits for output {i}: {_last_error()}")
        return tok

    def confidence(self, i: int = -1) -> tuple[int, float, float]:
        """(greedy token, top-1 probability, entropy in nats) of output ``i``'s softmax,
        computed in C (patch 0011): what a draft-length policy reads of each drafted token,
        without copying the n_vocab logits into numpy for a softmax there (Ice Lake Xeon,
        reduced-head draft: 0.20 ms against 1.29, ~5% of its 23 ms decode). Terms more than
        24 below the max are left out (< 1.5e-4 nats over a 152k vocabulary)."""
        top1, ent = ctypes.c_float(), ctypes.c_float()
        tok = _ffi.llama_specee_confidence(self.ptr, i, ctypes.byref(top1), ctypes.byref(ent))
        if tok < 0:
            raise DecodeError(f"no logits for output {i}: {_last_error()}")
        return tok, top1.value, ent.value

    def keep_sequences_apart(self, n_cells: int) -> bool:
        """Sequence s of this unified cache keeps its cells in [s*n_cells, (s+1)*n_cells), in
        position order (patch 0017): each sequence's rows then decode bit for bit as in a
        context of its own, whatever the others decode or free. Before the first decode;
        False where this context's memory is not one such cache (sliding-window layers,
        recurrent state)."""
        return bool(_ffi.llama_specee_seq_cells(self.ptr, n_cells))

    def seq_rm(self, p0: int, p1: int = -1, seq_id: int = 0) -> None:
        """Remove positions [p0, p1) of sequence ``seq_id`` from the KV cache (p1 -1: to the
        end)."""
        if not ll.llama_memory_seq_rm(self.mem, seq_id, p0, p1):
            raise SpeceeError(f"KV cache could not remove positions [{p0}, {p1}) of "
                              f"sequence {seq_id}")

    def clear(self) -> None:
        ll.llama_memory_clear(self.mem, True)

    def set_layer_inp(self, il: int, enable: bool) -> None:
        """Capture the residual stream entering layer ``il`` in the following decodes."""
        rc = _ffi.llama_specee_set_layer_inp(self.ptr, il, enable)
        if rc == -1:
            raise SpeceeError(f"layer {il} out of range [0, {self.model.n_layer})")
        if rc == -2:
            raise UnsupportedArchitectureError(
                f"per-layer hidden states are not available for architecture "
                f"{self.model.info.arch!r} (supported: llama, qwen2, qwen3)")
        if rc == -3:
            raise SpeceeError("layer-input capture cannot change while a staged decode is open")

    def layer_inp(self, il: int, n_tokens: int) -> np.ndarray:
        """Copy of the residual stream entering layer ``il``: (n_tokens, n_embd) of the last
        decode."""
        ptr = _ffi.llama_specee_get_layer_inp(self.ptr, il)
        if not ptr:
            raise SpeceeError(f"layer {il} input was not captured; call set_layer_inp first")
        return np.ctypeslib.as_array(ptr, shape=(n_tokens, self.model.n_embd)).copy()

    # -- staged decode (SpecEE): see llama_specee_stage_* in the patched llama.h ----------

    def stage_begin(self, batch: Batch) -> None:
        """Allocate KV cells for ``batch`` and run no layer yet."""
        arch = self.model.info.arch
        if arch not in STAGED_ARCHS:
            raise UnsupportedArchitectureError(
                f"early exit is not available for architecture {arch!r} "
                f"(supported: {', '.join(STAGED_ARCHS)})")
        rc = _ffi.llama_specee_stage_begin(self.ptr, batch.raw)
        self._stage_n_tokens = int(batch.raw.n_tokens) if rc == 0 else 0
        if rc == 1:
            raise ContextOverflowError(f"no KV cache slot for {batch.raw.n_tokens} tokens "
                                       f"(n_ctx {self.n_ctx})")
        if rc != 0:
            raise DecodeError(f"llama_specee_stage_begin returned {rc}: {_last_error()}")

    def stage_run(self, il_end: int, cand: np.ndarray | None = None) -> np.ndarray | None:
        """Run layers up to ``il_end``. ``cand``: (n_tokens, n_cand) token ids whose logits at
        layer ``il_end`` are returned, same shape, float32. ``il_end == n_layer`` finishes."""
        n_tokens = self.stage_n_tokens
        if cand is None or il_end == self.model.n_layer:
            rc = _ffi.llama_specee_stage_run(self.ptr, il_end, None, 0, None)
            out = None
        else:
            cand = np.ascontiguousarray(cand, dtype=np.int32)
            if n_tokens == 0 or cand.size == 0 or cand.size % n_tokens:
                raise DecodeError(f"candidates of shape {cand.shape} for a staged batch of "
                                  f"{n_tokens} tokens (need n_tokens x n_cand; stage_begin first)")
            cand = cand.reshape(n_tokens, -1)
            out = np.empty(cand.shape, dtype=np.float32)
            rc = _ffi.llama_specee_stage_run(
                self.ptr, il_end, cand.ctypes.data_as(ctypes.POINTER(ll.llama_token)),
                cand.shape[1], out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if rc != 0:
            raise DecodeError(f"llama_specee_stage_run(il_end={il_end}) returned {rc} "
                              f"(layer {self.stage_layer}): {_last_error()}")
        return out

    def stage_head(self) -> None:
        """Full logits at the current layer (read with ``logits``); the stage stays open."""
        rc = _ffi.llama_specee_stage_head(self.ptr)
        if rc != 0:
            raise DecodeError(f"llama_specee_stage_head returned {rc}: {_last_error()}")

    def stage_exit(self, full_head: bool = True) -> None:
        """Exit at the current layer: fill the skipped layers' K/V; logits if ``full_head``."""
        rc = _ffi.llama_specee_stage_exit(self.ptr, full_head)
        if rc != 0:
            raise DecodeError(f"llama_specee_stage_exit returned {rc}: {_last_error()}")

    def stage_abort(self) -> None:
        _ffi.llama_specee_stage_abort(self.ptr)

    @property
    def stage_layer(self) -> int:
        """Layers run in the open stage, -1 if none is open."""
        return int(_ffi.llama_specee_stage_layer(self.ptr))

    @property
    def stage_n_tokens(self) -> int:
        return self._stage_n_tokens

    def stage_bytes(self) -> int:
        """Memory this context holds for staged decoding (the residual store, on the output
        layer's device): 0 until the first stage_begin."""
        return int(_ffi.llama_specee_stage_bytes(self.ptr))

    def stage_hidden(self) -> np.ndarray:
        """Copy of the residual after the layers run so far: (n_tokens, n_embd). The residual
        stays on the device between segments; this downloads it."""
        ptr = _ffi.llama_specee_stage_hidden(self.ptr)
        if not ptr:
            raise SpeceeError("no open stage with a layer run")
        return np.ctypeslib.as_array(ptr, shape=(self._stage_n_tokens, self.model.n_embd)).copy()


def quantize_file(src: Path, dst: Path, ftype: int, n_threads: int,
                  head_type: int | None = None) -> None:
    """llama.cpp's quantizer: write ``src`` re-encoded as llama_ftype ``ftype`` to ``dst``
    (requantizing an already quantized model is allowed). ``head_type`` (a ggml type id)
    overrides llama.cpp's choice for the LM head and the token embeddings (Q6_K/Q8_0 by
    default), e.g. to test a head in the type the rest of the model has."""
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    params.allow_requantize = True
    if head_type is not None:
        params.output_tensor_type = head_type
        params.token_embedding_type = head_type
    _LOG.clear()
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SpeceeError(f"quantizing {src} failed ({rc}): {_last_error()}")

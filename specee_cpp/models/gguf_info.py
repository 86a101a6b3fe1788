"""Fast, validating read of a GGUF file's header.

llama.cpp answers a bad file with a log line and a NULL model; this reads the header
first so that the user gets the reason (missing, not GGUF, truncated) in one line, plus the
facts the engine needs before loading: architecture, layers, quantization and a tokenizer
fingerprint to check that a draft matches its target. Only the metadata is read (mmap);
tensor data is never touched, so this takes well under a second on a 1 GB model.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType,
                  LlamaFileType)

from ..errors import ModelFileError
from .registry import require_file

# The format's ids and widths are gguf's (the package llama.cpp ships); only the walk over
# the header is ours: gguf.GGUFReader parses every tensor and token entry into numpy views
# and takes 9 s on the 1.5B default target where this takes 0.15-0.2 s (2-core x86).
_MAGIC = struct.pack("<I", GGUF_MAGIC)
_U64 = struct.Struct("<Q")
_SCALAR = {vt: np.dtype(t).newbyteorder("<") for vt, t in GGUFReader.gguf_scalar_to_np.items()}
_STRING, _ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
# Arrays kept as raw bytes for fingerprinting instead of being decoded (~150k entries each).
_RAW_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores"}


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    arch: str
    name: str
    file_type: str          # e.g. "MOSTLY_Q4_K_M"; "unknown" when the key is absent
    n_layer: int
    n_embd: int
    n_vocab: int
    n_tensors: int
    chat_template: str | None
    tokenizer_fingerprint: str
    file_size: int
    data_end: int           # offset just past the last tensor's data
    weight_types: frozenset[str] = frozenset()   # ggml type names of its matrices ("Q4_K")

    @property
    def quant(self) -> str:
        return self.file_type.removeprefix("MOSTLY_")


class _Reader:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        except struct.error:
            raise self.truncated() from None
        self.pos += struct.calcsize(fmt)
        return v

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise self.truncated()
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, dtype: np.dtype):
        if self.pos + dtype.itemsize > len(self.buf):
            raise self.truncated()
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0].item()
        self.pos += dtype.itemsize
        return v

    def string(self) -> str:
        return self.raw(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """``count`` strings in a row: a vocabulary's 150k tokens or merges, in one loop
        (a call per string took a third of a large vocabulary's header time)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise self.truncated()
            pos += 8 + length(buf, pos)[0]
        if pos > end:
            raise self.truncated()
        self.pos = pos

    def truncated(self) -> ModelFileError:
        return ModelFileError(f"truncated or corrupt GGUF file (header runs past byte "
                              f"{len(self.buf)}): {self.path}")

    def bound(self, count: int, min_bytes: int, what: str) -> None:
        """A count that the rest of the file cannot hold is corrupt: say so before looping
        over it (a count of 2**63 would otherwise run for minutes)."""
        if count * min_bytes > len(self.buf) - self.pos:
            raise ModelFileError(f"corrupt GGUF file: {what} count {count} does not fit in the "
                                 f"{len(self.buf) - self.pos} bytes left: {self.path}")

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if depth >= 2:  # llama.cpp reads no nested arrays; thousands of levels are an attack
                raise ModelFileError(f"corrupt GGUF file: arrays nested {depth + 1} deep under "
                                     f"{key!r}: {self.path}")
            elem = _SCALAR[etype].itemsize if etype in _SCALAR else 8 if etype in (
                _STRING, _ARRAY) else 1
            self.bound(count, elem, f"array {key!r}")
            start = self.pos
            if key in _RAW_ARRAYS:
                if etype == _STRING:
                    self.skip_strings(count)
                elif etype in _SCALAR:
                    self.raw(count * _SCALAR[etype].itemsize)
                else:
                    raise ModelFileError(f"bad GGUF array type {etype} for {key}: {self.path}")
                return _RawArray(count, bytes(self.buf[start:self.pos]))
            return [self.value(etype, key, depth + 1) for _ in range(count)]
        raise ModelFileError(f"bad GGUF value type {vtype} for key {key!r}: {self.path}")


@dataclass(frozen=True)
class _RawArray:
    count: int
    data: bytes


@dataclass(frozen=True)
class _Tensor:
    name: str
    dims: list[int]
    type: int
    offset: int     # from the start of the data section
    nbytes: int


# a tensor table that does not parse as one is most often a key-value count off by one
_COUNT_HINT = " (the header's key-value or tensor count may be wrong)"


def _tensor_nbytes(name: str, ggml_type: int, dims: list[int], path: Path,
                   first: bool = False) -> int:
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(f"corrupt GGUF file: tensor {name!r} has unknown type {ggml_type}"
                             f"{_COUNT_HINT if first else ''}: {path}") from None
    if dims[0] % block:
        # ggml stores whole blocks per row: such a row is not one of this type
        raise ModelFileError(f"corrupt GGUF file: tensor {name!r} has rows of {dims[0]}, not a "
                             f"multiple of {qtype.name}'s block of {block}: {path}")
    n = 1
    for d in dims:
        n *= d
    return n // block * type_size


def _check_layout(tensors: list[_Tensor], align: int, path: Path) -> int:
    """Each tensor's data where the table's order puts it, as llama.cpp's reader requires
    (right after the one before, padded to the alignment): a shifted offset, or a type or
    shape that does not match the bytes written, moves it. The end of the data section."""
    end = 0
    for t in tensors:
        if t.offset != end:
            raise ModelFileError(f"corrupt GGUF file: tensor {t.name!r} starts at data offset "
                                 f"{t.offset}, where the tensors before it end at {end} (a "
                                 f"shifted offset, or a type or shape that does not match its "
                                 f"bytes): {path}")
        end = t.offset + (t.nbytes + align - 1) // align * align
    return tensors[-1].offset + tensors[-1].nbytes if tensors else 0


_INT_TYPES = {GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
              GGMLQuantizationType.I64, GGMLQuantizationType.F64}


def _check_tensor_types(tensors, path: Path) -> None:
    """Types that fit each tensor's role, checked before llama.cpp sees them: it aborts the
    process inside a graph op (``binary_op: unsupported types``) on a norm stored as F16 or
    I32. llama.cpp's converter and quantizer write every vector (norms, biases, rope factors)
    as F32, and no weight of a language model is an integer or F64 tensor."""
    for t in tensors:
        qtype = GGMLQuantizationType(t.type)
        if qtype in _INT_TYPES:
            raise ModelFileError(f"tensor {t.name!r} is {qtype.name}; a model's weights are "
                                 f"float or quantized: {path}")
        if len(t.dims) == 1 and qtype != GGMLQuantizationType.F32:
            raise ModelFileError(f"tensor {t.name!r} is a vector stored as {qtype.name}; "
                                 f"llama.cpp needs vectors (norms, biases) in F32: {path}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# llama.cpp's own limit on layers (LLAMA_MAX_LAYERS)
_MAX_LAYERS = 512
# a trained context past this is a corrupt header: the longest models train on ~10M tokens
_MAX_CONTEXT = 1 << 27
# decoder-only text architectures: their vocabularies are SentencePiece or BPE, never BERT's
# WordPiece or T5's Unigram (llama.cpp loads such a mix and produces garbage)
_DECODER_ARCHS = {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "mistral3", "gemma",
                  "gemma2", "gemma3", "phi2", "phi3", "starcoder2", "granite", "olmo", "olmo2"}
_DECODER_TOKENIZERS = {"llama", "gpt2"}


def _check_hparams(kv: dict, arch: str, path: Path) -> None:
    """Values llama.cpp asserts on, or silently computes garbage with, refused here with the
    key and the value: the loader aborts the whole process instead of returning an error."""
    def bad(key: str, why: str) -> ModelFileError:
        return ModelFileError(f"bad {key} {kv.get(key)!r} ({why}): {path}")

    key = f"{arch}.block_count"
    n = kv.get(key)
    if not _is_int(n) or not 1 <= n <= _MAX_LAYERS:
        raise bad(key, f"need an integer in 1..{_MAX_LAYERS}")
    key = f"{arch}.context_length"
    v = kv.get(key)
    if v is not None and (not _is_int(v) or not 1 <= v <= _MAX_CONTEXT):
        raise bad(key, f"need an integer in 1..{_MAX_CONTEXT}")
    for name in ("embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv"):
        key = f"{arch}.{name}"
        v = kv.get(key)
        if v is None or isinstance(v, list):  # absent, or per-layer arrays: llama.cpp checks
            continue
        if not _is_int(v) or not 0 <= v < 2**31:
            raise bad(key, "need a non-negative integer")
    for name in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        key = f"{arch}.{name}"
        v = kv.get(key)
        if v is not None and not (isinstance(v, float) and math.isfinite(v) and 0 < v < 1):
            raise bad(key, "need a finite number in (0, 1)")
    for name in ("rope.freq_base", "rope.scaling.factor"):
        key = f"{arch}.{name}"
        v = kv.get(key)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise bad(key, "need a finite positive number")
    model = kv.get("tokenizer.ggml.model")
    if arch in _DECODER_ARCHS and model is not None and model not in _DECODER_TOKENIZERS:
        raise bad("tokenizer.ggml.model", f"a {arch} model needs a "
                  f"{' or '.join(sorted(_DECODER_TOKENIZERS))} vocabulary")


def _check_unique_tokens(tokens: _RawArray, path: Path) -> None:
    """llama.cpp maps token text to id and asserts that no two tokens share a text (a
    corrupted vocabulary aborts the process at load). ~50 ms for 150k tokens."""
    data, pos, seen = tokens.data, 0, set()
    for i in range(tokens.count):
        (n,) = struct.unpack_from("<Q", data, pos)
        # llama.cpp reads each token as a C string: text after a NUL byte does not count
        text = data[pos + 8:pos + 8 + n].split(b"\0", 1)[0]
        pos += 8 + n
        if text in seen:
            raise ModelFileError(f"corrupt vocabulary: token {i} {text[:40]!r} appears twice "
                                 f"in tokenizer.ggml.tokens: {path}")
        seen.add(text)


# the special tokens' ids a vocabulary names; gguf's converter drops one out of range, so
# such an id is a corruption (llama.cpp would fall back to a default token in its place)
_SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "cls", "mask",
                "prefix", "suffix", "middle", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
                "fim_rep", "fim_sep")


def _check_vocab(kv: dict, arch: str, n_vocab: int, tensors: dict, path: Path) -> None:
    """The vocabulary agrees with itself and with the model: a special token's id in range,
    the embedding and ``vocab_size`` as long as the token list, a BPE vocabulary's merges
    not cut short (each token past the 256 bytes is made by a merge; a cut list tokenizes
    into bytes and the answers are garbled)."""
    for name in _SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        v = kv.get(key)
        if v is not None and (not _is_int(v) or not 0 <= v < n_vocab):
            raise ModelFileError(f"bad {key} {v!r} (the vocabulary has {n_vocab} tokens): "
                                 f"{path}")
    size = kv.get(f"{arch}.vocab_size")
    if size is not None and size != n_vocab:
        raise ModelFileError(f"bad {arch}.vocab_size {size!r} (the token list has {n_vocab}): "
                             f"{path}")
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.dims) == 2 and embd.dims[1] != n_vocab:
        raise ModelFileError(f"token_embd.weight has {embd.dims[1]} rows for {n_vocab} tokens: "
                             f"{path}")
    merges, types = kv.get("tokenizer.ggml.merges"), kv.get("tokenizer.ggml.token_type")
    if kv.get("tokenizer.ggml.model") == "gpt2" and isinstance(types, _RawArray) \
            and types.count == n_vocab and len(types.data) == 4 * n_vocab:
        n_normal = int(np.count_nonzero(np.frombuffer(types.data, dtype="<i4") == 1))
        n_merges = merges.count if isinstance(merges, _RawArray) else 0
        if n_merges < (n_normal - 256) // 2:
            raise ModelFileError(f"tokenizer.ggml.merges has {n_merges} entries for {n_normal} "
                                 f"normal tokens (a BPE vocabulary has about one per token "
                                 f"past the 256 bytes; cut short?): {path}")


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Validate ``path`` as a complete GGUF file and return its header facts."""
    path = Path(path)
    require_file(path)
    size = path.stat().st_size
    try:
        fh = open(path, "rb")
    except OSError as e:  # permissions, a directory, a vanished file
        raise ModelFileError(f"cannot read model file {path}: {e.strerror or e}") from None
    with fh:
        head = fh.read(4)
        if head != _MAGIC:
            raise ModelFileError(f"not a GGUF file (starts with {head!r}, expected b'GGUF'): "
                                 f"{path}")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(_Reader(mm, path), size)


def _parse(r: _Reader, size: int) -> GGUFInfo:
    r.pos = 4
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ModelFileError(f"unsupported GGUF version {version}: {r.path}")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    r.bound(n_kv, 13, "key-value")        # key length, one byte of key, value type
    r.bound(n_tensors, 24, "tensor")      # name length, n_dims, type, offset
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        if key in kv:
            raise ModelFileError(f"corrupt GGUF file: key {key!r} appears twice: {r.path}")
        kv[key] = r.value(r.unpack("<I"), key)
    tensors: dict[str, _Tensor] = {}
    n_blocks = 0
    for i in range(n_tensors):
        name = r.string()
        if name in tensors:
            raise ModelFileError(f"corrupt GGUF file: tensor {name!r} appears twice: {r.path}")
        if name.startswith("blk."):
            idx = name.split(".")[1]
            n_blocks = max(n_blocks, int(idx) + 1 if idx.isdigit() else 0)
        n_dims = r.unpack("<I")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise ModelFileError(f"corrupt GGUF file: tensor {name!r} has {n_dims} dimensions"
                                 f"{_COUNT_HINT if i == 0 else ''}: {r.path}")
        dims = [r.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = r.unpack("<I"), r.unpack("<Q")
        tensors[name] = _Tensor(name, dims, ggml_type, offset,
                                _tensor_nbytes(name, ggml_type, dims, r.path, i == 0))
    align = kv.get("general.alignment", 32)
    if not _is_int(align) or align < 8 or align & (align - 1):
        raise ModelFileError(f"bad general.alignment {align!r} (need a power of two >= 8): "
                             f"{r.path}")
    _check_tensor_types(tensors.values(), r.path)   # the precise reason before the layout's
    data_rel_end = _check_layout(list(tensors.values()), align, r.path)
    data_start = (r.pos + align - 1) // align * align
    data_end = data_start + data_rel_end
    if data_end > size:
        raise ModelFileError(f"truncated GGUF file: tensor data needs {data_end} bytes, "
                             f"file has {size}: {r.path}")
    arch = kv.get("general.architecture", "")
    if not arch or not isinstance(arch, str):
        raise ModelFileError(f"GGUF file has no general.architecture: {r.path}")
    _check_hparams(kv, arch, r.path)
    if n_blocks and n_blocks != kv[f"{arch}.block_count"]:
        raise ModelFileError(f"bad {arch}.block_count {kv[f'{arch}.block_count']} (the file "
                             f"has tensors for {n_blocks} layers): {r.path}")
    tokens = kv.get("tokenizer.ggml.tokens")
    if isinstance(tokens, _RawArray):
        _check_unique_tokens(tokens, r.path)
        _check_vocab(kv, arch, tokens.count, tensors, r.path)
    fp = hashlib.sha256()
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        fp.update(str(kv.get(key, "")).encode() + b"\0")
    fp.update(tokens.data if isinstance(tokens, _RawArray) else b"")
    ftype = kv.get("general.file_type")
    try:
        file_type = LlamaFileType(ftype).name if ftype is not None else "unknown"
    except ValueError:
        file_type = f"type {ftype}"
    return GGUFInfo(
        path=r.path, version=version, arch=arch, name=str(kv.get("general.name", "")),
        file_type=file_type, n_layer=int(kv.get(f"{arch}.block_count", 0)),
        n_embd=int(kv.get(f"{arch}.embedding_length", 0)),
        n_vocab=tokens.count if isinstance(tokens, _RawArray) else 0,
        n_tensors=n_tensors, chat_template=kv.get("tokenizer.chat_template"),
        tokenizer_fingerprint=fp.hexdigest()[:16], file_size=size, data_end=data_end,
        weight_types=frozenset(GGMLQuantizationType(t.type).name for t in tensors.values()
                               if len(t.dims) > 1),
    )

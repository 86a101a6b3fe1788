"""Fast, validating read of a GGUF file's header.

llama.cpp answers a bad file with a log line and a NULL model; this reads the header
first so that the user gets the reason (missing, not GGUF, truncated) in one line, plus the
facts the engine needs before loading: architecture, layers, quantization and a tokenizer
fingerprint to check that a draft matches its target. Only the metadata is read (mmap);
tensor data is never touched, so this takes well under a second on a 1 GB model.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ..errors import ModelFileError

_MAGIC = b"GGUF"
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
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

    def string(self) -> str:
        return self.raw(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise self.truncated()

    def truncated(self) -> ModelFileError:
        return ModelFileError(f"truncated GGUF file (header ends past byte {len(self.buf)}): "
                              f"{self.path}")

    def value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            start = self.pos
            if key in _RAW_ARRAYS:
                if etype == _STRING:
                    for _ in range(count):
                        self.skip_string()
                elif etype in _SCALAR:
                    self.raw(count * struct.calcsize(_SCALAR[etype]))
                else:
                    raise ModelFileError(f"bad GGUF array type {etype} for {key}: {self.path}")
                return _RawArray(count, bytes(self.buf[start:self.pos]))
            return [self.value(etype, key) for _ in range(count)]
        raise ModelFileError(f"bad GGUF value type {vtype} for key {key!r}: {self.path}")


@dataclass(frozen=True)
class _RawArray:
    count: int
    data: bytes


def _tensor_nbytes(ggml_type: int, dims: list[int], path: Path) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFileError(f"unknown tensor type {ggml_type} in {path}") from None
    n = 1
    for d in dims:
        n *= d
    return n // block * type_size


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Validate ``path`` as a complete GGUF file and return its header facts."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
        if head != _MAGIC:
            raise ModelFileError(f"not a GGUF file (starts with {head!r}, expected b'GGUF'): {path}")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(_Reader(mm, path), size)


def _parse(r: _Reader, size: int) -> GGUFInfo:
    r.pos = 4
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ModelFileError(f"unsupported GGUF version {version}: {r.path}")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        kv[key] = r.value(r.unpack("<I"), key)
    data_rel_end = 0
    for _ in range(n_tensors):
        r.skip_string()
        dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
        ggml_type, offset = r.unpack("<I"), r.unpack("<Q")
        data_rel_end = max(data_rel_end, offset + _tensor_nbytes(ggml_type, dims, r.path))
    align = int(kv.get("general.alignment", 32))
    data_start = (r.pos + align - 1) // align * align
    data_end = data_start + data_rel_end
    if data_end > size:
        raise ModelFileError(f"truncated GGUF file: tensor data needs {data_end} bytes, "
                             f"file has {size}: {r.path}")
    arch = str(kv.get("general.architecture", ""))
    if not arch:
        raise ModelFileError(f"GGUF file has no general.architecture: {r.path}")
    tokens = kv.get("tokenizer.ggml.tokens")
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
    )

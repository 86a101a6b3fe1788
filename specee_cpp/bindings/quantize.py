"""The quantization ladder: target variants made with llama.cpp's own quantizer.

IQ4_NL (non-uniform 4-bit) is our counterpart of NF4. Requantizing is allowed, but going up
in precision (say Q4_K_M -> Q8_0) gains no fidelity: the information lost by the first
quantization is not restored.
"""
from __future__ import annotations

import os
from pathlib import Path

from gguf import LlamaFileType

from ..config import default_threads
from ..errors import SpeceeError
from ..models.gguf_info import read_gguf_info

# name -> (llama_ftype from gguf's enum, approximate bits per weight of the whole file)
_BITS = {"F16": 16.0, "Q8_0": 8.5, "Q6_K": 6.6, "Q5_K_M": 5.7, "Q4_K_M": 4.9, "Q4_0": 4.5,
         "IQ4_NL": 4.5, "Q3_K_M": 3.9, "Q2_K": 2.6}
TYPES = {name: (int(LlamaFileType[f"MOSTLY_{name}"]), bits) for name, bits in _BITS.items()}
_BITS_OF_FILE_TYPE = {"ALL_F32": 32.0, "MOSTLY_F16": 16.0, "MOSTLY_BF16": 16.0}


def parse_types(spec: str) -> list[str]:
    names = [t.strip().upper() for t in spec.split(",") if t.strip()]
    bad = [t for t in names if t not in TYPES]
    if bad or not names:
        raise SpeceeError(f"unknown quantization type(s) {bad or spec!r}; "
                          f"valid: {', '.join(TYPES)}")
    return names


def source_bits(file_type: str) -> float | None:
    if file_type in _BITS_OF_FILE_TYPE:
        return _BITS_OF_FILE_TYPE[file_type]
    quant = file_type.removeprefix("MOSTLY_")
    return TYPES[quant][1] if quant in TYPES else None


def variant(src: Path, qtype: str, n_threads: int = 0) -> Path:
    """``src`` requantized to ``qtype`` in the model cache, made on first use (a draft whose
    every matrix takes this machine's fast kernels, say); what ``NAME:TYPE`` resolves to."""
    from ..paths import models_dir

    (qtype,) = parse_types(qtype)
    out = models_dir() / f"{Path(src).name.removesuffix('.gguf')}.{qtype}.gguf"
    if out.is_file():
        return out
    path, _ = quantize(src, qtype, models_dir(), n_threads)
    return path


def quantize(src: Path, qtype: str, out_dir: Path, n_threads: int = 0) -> tuple[Path, str | None]:
    """Write ``src`` quantized as ``qtype`` into ``out_dir``; returns (path, warning or None).

    The file appears under its final name only once complete and readable.
    """
    from .llama import quantize_file

    info = read_gguf_info(src)
    ftype, bits = TYPES[qtype]
    stem = Path(src).name.removesuffix(".gguf")
    out = Path(out_dir) / f"{stem}.{qtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        quantize_file(Path(src), partial, ftype, n_threads or default_threads())
        read_gguf_info(partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    have = source_bits(info.file_type)
    warning = None
    if have is not None and bits > have:
        warning = (f"{qtype} from a {info.quant} source: going up in precision does not restore "
                   f"the fidelity lost by {info.quant}")
    return out, warning

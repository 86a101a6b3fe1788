"""Reduced-vocabulary draft heads (FR-Spec, arXiv 2502.14856).

A draft spends a large share of each token on its LM head: the 0.5B default draft's output
matrix (896 x 151,936, Q8_0) is 136M of the ~494M weights it multiplies per token. Most of
those rows are tokens a draft almost never proposes. A reduced head keeps the rows of the N
most frequent tokens only; the input embeddings stay full, so every token can still be read.

The file written here is the draft's GGUF with its ``output.weight`` (and bias) cut to those
rows and the int32 array ``specee.head.token_ids`` listing, increasing, the vocabulary id of
each kept row. Patch 0007 makes llama.cpp load such a head and return logits over the whole
vocabulary (-inf where the head has no row), so nothing above the bindings maps ids, and a
reduced draft stays a lossless draft: it only proposes fewer distinct tokens.

Which tokens to keep comes from a ranking shipped per tokenizer
(``bundles/<fingerprint>.head-ranking.npz``, made by ``scripts/head_vocab.py`` from dev data
and a code corpus); control tokens (end of turn, ...) are always kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from ..errors import ModelFileError, SpeceeError
from .gguf_info import read_gguf_info

HEAD_KEY = "specee.head.token_ids"          # LLAMA_SPECEE_HEAD_KEY in patch 0007
_OUTPUT, _BIAS, _EMBD = "output.weight", "output.bias", "token_embd.weight"
# GGUF token types that a draft must always be able to propose (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


def parse_size(spec: str) -> int:
    """``v32k`` / ``v32768`` -> 32768 (the head's row count)."""
    s = spec.strip().lower()
    if not s.startswith("v") or len(s) < 2:
        raise SpeceeError(f"not a head size {spec!r}; write v<N> or v<N>k, e.g. v32k")
    body, mult = (s[1:-1], 1024) if s.endswith("k") else (s[1:], 1)
    try:
        n = int(body) * mult
    except ValueError:
        raise SpeceeError(f"not a head size {spec!r}; write v<N> or v<N>k, e.g. v32k") from None
    if n < 64:
        raise SpeceeError(f"head size {spec!r} is {n} rows; use at least 64")
    return n


def ranking_path(tokenizer_fingerprint: str) -> Path:
    from ..paths import BUNDLE_DIR

    return BUNDLE_DIR / f"{tokenizer_fingerprint}.head-ranking.npz"


def load_ranking(tokenizer_fingerprint: str) -> tuple[np.ndarray, dict]:
    """(token ids, most frequent first; the ranking's metadata) for a tokenizer."""
    path = ranking_path(tokenizer_fingerprint)
    if not path.is_file():
        raise SpeceeError(
            f"no head ranking for tokenizer {tokenizer_fingerprint} ({path.name}); make one "
            f"with: python scripts/head_vocab.py --target TARGET")
    with np.load(path) as z:
        return z["ids"].astype(np.int64), json.loads(str(z["meta"]))


def save_ranking(tokenizer_fingerprint: str, ids: np.ndarray, counts: np.ndarray,
                 meta: dict) -> Path:
    path = ranking_path(tokenizer_fingerprint)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(tmp, ids=ids.astype(np.int32), counts=counts.astype(np.float32),
                        meta=np.array(json.dumps(meta, sort_keys=True)))
    os.replace(tmp, path)
    return path


def rank_tokens(proposed: np.ndarray, frequency: np.ndarray, corpus_tokens: int) -> np.ndarray:
    """Every token id, ranked for a reduced head: the draft's proposals (``proposed[i]``:
    how often the draft proposed token i; most first), then the ``corpus_tokens`` most
    frequent of the rest in the corpus (``frequency``), then every other id increasing.

    Ties break by id. The corpus is cut short because a code corpus's long tail ranks rare
    identifiers above common words the dev text lacks; BPE ids follow merge order, itself a
    frequency order over the tokenizer's far larger corpus."""
    ids = np.arange(proposed.size)
    by_use = np.lexsort((ids, -frequency, -proposed))
    first = by_use[:int((proposed > 0).sum()) + max(corpus_tokens, 0)]
    return np.concatenate([first, np.setdiff1d(ids, first, assume_unique=True)])


def control_tokens(reader) -> np.ndarray:
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:
        return np.zeros(0, dtype=np.int64)
    types = np.asarray(field.contents())
    return np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED))


def head_ids(ranking: np.ndarray, n: int, always: np.ndarray, n_vocab: int) -> np.ndarray:
    """The ``n`` kept ids, increasing: every control token, then the ranking's first ids
    until there are ``n`` (all of them if the ranking is shorter than needed)."""
    if n >= n_vocab:
        raise SpeceeError(f"a head of {n} rows is not reduced (the vocabulary has {n_vocab})")
    keep = dict.fromkeys(int(t) for t in always)
    for t in ranking:
        if len(keep) >= n:
            break
        keep.setdefault(int(t), None)
    ids = np.array(sorted(keep), dtype=np.int64)
    if ids.size and (ids[0] < 0 or ids[-1] >= n_vocab):
        raise SpeceeError(f"head ranking holds ids outside the vocabulary of {n_vocab}")
    return ids


def write_reduced(src: Path, out: Path, ranking: np.ndarray, n: int) -> tuple[Path, np.ndarray]:
    """Write ``src`` with its LM head cut to ``n`` rows (``head_ids`` of ``ranking``) as
    ``out``; returns (out, the kept ids). The file appears under its final name only once
    complete, so an interrupted write leaves nothing that looks usable."""
    import gguf

    src, out = Path(src), Path(out)
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    if HEAD_KEY in reader.fields:
        raise SpeceeError(f"{src.name} already has a reduced head")
    head = tensors.get(_OUTPUT) or tensors.get(_EMBD)
    if head is None:
        raise ModelFileError(f"{src} has neither {_OUTPUT} nor {_EMBD}")
    ids = head_ids(ranking, n, control_tokens(reader), int(head.data.shape[0]))
    # the head's own rows; a tied model (no output.weight) gets one cut from token_embd
    tensors_out = [(t.name, t.data, t.tensor_type) for t in reader.tensors
                   if t.name not in (_OUTPUT, _BIAS)]
    tensors_out.append((_OUTPUT, np.ascontiguousarray(head.data[ids]), head.tensor_type))
    if _BIAS in tensors:
        b = tensors[_BIAS]
        tensors_out.append((_BIAS, np.ascontiguousarray(b.data[ids]), b.tensor_type))
    write_gguf(reader, out, tensors_out, {HEAD_KEY: ids})
    return out, ids


def write_gguf(reader, out: Path, tensors: list, int32_arrays: dict) -> Path:
    """Write ``reader``'s metadata, with the int32 arrays ``int32_arrays`` added or replaced,
    and ``tensors`` [(name, data as the reader holds it, type)] as ``out``: written to
    ``out.partial``, checked readable, then renamed."""
    import gguf

    out = Path(out)
    arch = str(reader.fields["general.architecture"].contents())
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch, endianess=reader.endianess)
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") \
                    or field.name in int32_arrays:
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        for key, values in int32_arrays.items():
            writer.add_key_value(key, [int(i) for i in values], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.INT32)
        for name, data, ttype in tensors:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data, _ in tensors:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
        writer.close()
        read_gguf_info(partial)     # complete and readable before it takes the final name
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out


def reduced_name(src_name: str, n: int, digest: str) -> str:
    """The file name of ``src_name`` with a head of ``n`` rows (``digest``: of the ranking
    rows kept, 8 hex digits); ``_REDUCED_NAME`` reads it back."""
    return f"{src_name.removesuffix('.gguf')}.v{n}-{digest}.gguf"


_REDUCED_NAME = re.compile(r"\.v\d+-[0-9a-f]{8}\.gguf$")


def full_head_file(path: Path) -> Path:
    """The file a reduced-head draft was cut from (``reduced_variant`` writes it beside its
    source, named by ``reduced_name``); ``path`` itself when its head is whole.
    llama.cpp's own tools cannot load a reduced head (its output rows do not match the
    vocabulary): a peer given "the same draft" gets the same weights with the whole head."""
    import gguf

    path = Path(path)
    if HEAD_KEY not in gguf.GGUFReader(path).fields:
        return path
    src = path.with_name(_REDUCED_NAME.sub(".gguf", path.name))
    if src == path or not src.is_file():
        raise SpeceeError(f"{path.name} has a reduced head and its full-head source {src.name} "
                          f"is not beside it")
    return src


def reduced_variant(src: Path, n: int) -> Path:
    """``src`` with a head of ``n`` rows in the model cache, made on first use; what
    ``NAME:vN`` resolves to."""
    from ..paths import models_dir

    src = Path(src)
    ranking, _ = load_ranking(read_gguf_info(src).tokenizer_fingerprint)
    # the ranking's digest is in the name: a new ranking makes a new file, never reuses one
    digest = hashlib.sha256(np.ascontiguousarray(ranking[:n], dtype=np.int64)).hexdigest()[:8]
    out = models_dir() / reduced_name(src.name, n, digest)
    if out.is_file():
        return out
    return write_reduced(src, out, ranking, n)[0]

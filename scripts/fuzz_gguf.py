#!/usr/bin/env python3
"""Fuzz model loading with corrupted copies of a real GGUF, and count what happens.

Each variant of the source file (truncations, byte flips in the header, absurd counts,
headers rebuilt with bad hyperparameter values, nested arrays, duplicated keys and tensors,
tensor types that do not fit their role or their bytes, shifted data, a vocabulary that
disagrees with itself, chat templates that do not compile, loop for ever or write
gigabytes) is given to ``specee-cpp generate FILE -p hi -n 4`` in a child process, one
variant at a time (one copy of the file in memory). Outcomes:

- ok:        exit 0 (a random corruption hit something harmless, e.g. a token's text)
- accepted:  exit 0 for a targeted corruption: a bad file taken silently (a bug)
- error:     exit 1 with a one-line ``error:`` message (what we want for a bad file)
- traceback: a Python traceback (a bug: an exception we did not turn into an error)
- abort:     killed by a signal (SIGABRT from GGML_ASSERT, SIGSEGV): the bug class to remove
- hang:      no answer within the timeout

    python scripts/fuzz_gguf.py MODEL.gguf --n 253 --seed 0      # the full run
    python scripts/fuzz_gguf.py smollm2-135m --n 40               # a registry name works too

Exit 0 when no variant gave a traceback, an abort, a hang or a silent acceptance. Runs in
the project's venv.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

U32, I32, F32, STR, ARR = 4, 5, 6, 8, 9      # GGUF value types
F16, Q4_0, Q5_0, Q8_0, I8, I32_T = 1, 2, 6, 8, 24, 26   # ggml tensor types


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _enc_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _enc_str(key) + struct.pack("<I", vtype) + payload


class Source:
    """The source GGUF split into its parts, so that headers can be rebuilt."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        self.raw = path.read_bytes()
        r = GGUFReader(str(path))
        self.fields = {}
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            self.fields[name] = (f.offset, sum(p.nbytes for p in f.parts))
        last = max(o + n for o, n in self.fields.values())
        first = min(o for o, _ in self.fields.values())
        self.kv_start, self.kv_end = first, last
        self.ti_end = max(t.field.offset + sum(p.nbytes for p in t.field.parts) for t in r.tensors)
        self.data_offset = r.data_offset
        self.n_tensors = len(r.tensors)
        self.alignment = 32
        # per tensor: (name, byte position of its type in the file, its type)
        self.tensors = {}
        for t in r.tensors:
            parts = t.field.parts
            at = t.field.offset + sum(p.nbytes for p in parts[:-2])
            self.tensors[t.name] = (at, int(t.tensor_type))
        merges = r.fields.get("tokenizer.ggml.merges")
        self.merges = [bytes(merges.parts[i]) for i in merges.data[:10]] if merges else []
        tokens = r.fields.get("tokenizer.ggml.tokens")
        self.n_vocab = len(tokens.data) if tokens else 0

    def patched(self, at: int, fmt: str, value) -> bytes:
        """The file with one value of the header overwritten in place."""
        b = bytearray(self.raw)
        struct.pack_into(fmt, b, at, value)
        return bytes(b)

    def tensor_type(self, name: str, ggml_type: int) -> bytes:
        return self.patched(self.tensors[name][0], "<I", ggml_type)

    def tensor_offset(self, name: str, delta: int) -> bytes:
        at = self.tensors[name][0] + 4
        return self.patched(at, "<Q", struct.unpack_from("<Q", self.raw, at)[0] + delta)

    def tensor_renamed(self, name: str, to: str) -> bytes:
        """A tensor's name replaced by another of the same length (``to``)."""
        at = self.tensors[name][0]
        b = self.raw
        start = b.rfind(name.encode(), 0, at)
        return b[:start] + to.encode() + b[start + len(to):]

    def rebuild(self, replace: dict[str, bytes | None], extra: list[bytes] = ()) -> bytes:
        """The file with the kv entries in ``replace`` swapped for new encodings (None drops
        one), ``extra`` entries appended; tensor infos and data unchanged, data re-aligned."""
        entries = []
        for name, (off, n) in sorted(self.fields.items(), key=lambda kv: kv[1][0]):
            if name in replace:
                if replace[name] is not None:
                    entries.append(replace[name])
            else:
                entries.append(self.raw[off:off + n])
        entries += list(extra)
        head = self.raw[:8] + struct.pack("<QQ", self.n_tensors, len(entries))
        body = head + b"".join(entries) + self.raw[self.kv_end:self.ti_end]
        align = self.alignment
        for e in entries:
            if e.startswith(_enc_str("general.alignment")):
                v = struct.unpack_from("<I", e, len(_enc_str("general.alignment")) + 4)[0]
                align = v if v > 0 else align
        pad = (-len(body)) % align
        return body + b"\0" * pad + self.raw[self.data_offset:]


def targeted(src: Source):
    """(name, make) pairs: corruptions a loader must refuse, each built only when run."""
    arch = "llama"
    raw = src.raw

    def u32(key, v):
        return _enc_kv(key, U32, struct.pack("<I", v))

    def f32(key, v):
        return _enc_kv(key, F32, struct.pack("<f", v))

    def s(key, v):
        return _enc_kv(key, STR, _enc_str(v))

    def kv(replace, extra=()):
        return lambda: src.rebuild(replace, extra)

    for v in (0, 1000, 2**32 - 1):
        yield f"block_count={v}", kv({f"{arch}.block_count": u32(f"{arch}.block_count", v)})
    yield "block_count=str", kv({f"{arch}.block_count": s(f"{arch}.block_count", "thirty")})
    for v in (math.nan, -1.0, math.inf, 0.0):
        key = f"{arch}.attention.layer_norm_rms_epsilon"
        yield f"eps={v}", kv({key: f32(key, v)})
    for v in (math.nan, 0.0, -1.0, math.inf):
        key = f"{arch}.rope.freq_base"
        yield f"freq_base={v}", kv({key: f32(key, v)})
    for v in (0, 1, 3):
        yield f"alignment={v}", kv({}, [u32("general.alignment", v)])
    yield "alignment=str", kv({}, [s("general.alignment", "32")])
    for v in ("bert", "t5", "nonsense"):
        yield f"tokenizer={v}", kv({"tokenizer.ggml.model": s("tokenizer.ggml.model", v)})
    for key in ("embedding_length", "attention.head_count", "context_length"):
        k = f"{arch}.{key}"
        yield f"{key}=0", kv({k: u32(k, 0)})
        yield f"{key}=str", kv({k: s(k, "x")})
    k = f"{arch}.context_length"
    yield "context_length=2^31-1", kv({k: u32(k, 2**31 - 1)})
    nested = struct.pack("<I", ARR) + b"".join(struct.pack("<IQ", ARR, 1) for _ in range(3000))
    nested += struct.pack("<IQ", U32, 1) + struct.pack("<I", 7)
    yield "nested-arrays-3000", kv({}, [_enc_kv("x.nested", ARR, nested[4:])])
    yield "array-count-2^63", kv({}, [_enc_kv("x.huge", ARR, struct.pack("<IQ", U32, 2**63))])
    for name, text in TEMPLATES.items():
        yield f"chat-template-{name}", kv({"tokenizer.chat_template":
                                           s("tokenizer.chat_template", text)})
    yield "no-architecture", kv({"general.architecture": None})
    yield "duplicate-key", kv({}, [s("general.architecture", arch)])
    # the vocabulary against itself and the model
    for key in ("bos", "eos"):
        k = f"tokenizer.ggml.{key}_token_id"
        yield f"{key}_id=n_vocab", kv({k: u32(k, src.n_vocab)})
    k = f"{arch}.vocab_size"
    yield "vocab_size+1", kv({k: u32(k, src.n_vocab + 1)})
    if src.merges:
        cut = _enc_kv("tokenizer.ggml.merges", ARR, struct.pack("<IQ", STR, len(src.merges))
                      + b"".join(_enc_str(m) for m in src.merges))
        yield "merges-cut-to-10", kv({"tokenizer.ggml.merges": cut})
    # the tensor table: types that do not fit a tensor's role or its bytes, moved data,
    # a name given twice
    for name in ("output_norm.weight", "blk.0.attn_norm.weight"):
        for t in (F16, I32_T, I8):
            yield f"type:{name}={t}", lambda name=name, t=t: src.tensor_type(name, t)
    matrix = "blk.0.ffn_up.weight"
    for t in (Q4_0, Q5_0, Q8_0):   # all blocks of 32 values: a same-shape swap
        if src.tensors[matrix][1] != t:
            yield f"type:{matrix}={t}", lambda t=t: src.tensor_type(matrix, t)
    for delta in (1, 32, -32):
        yield f"offset:{matrix}{delta:+d}", lambda d=delta: src.tensor_offset(matrix, d)
    yield "duplicate-tensor", lambda: src.tensor_renamed("blk.1.ffn_up.weight",
                                                         "blk.0.ffn_up.weight")
    # the header's counts
    for d in (1, -1):
        yield f"n_kv{d:+d}", lambda d=d: src.patched(16, "<Q", len(src.fields) + d)
    yield "n_kv=2^63", lambda: raw[:16] + struct.pack("<Q", 2**63) + raw[24:]
    yield "n_tensors=2^40", lambda: raw[:8] + struct.pack("<Q", 2**40) + raw[16:]
    yield "n_tensors=0", lambda: raw[:8] + struct.pack("<Q", 0) + raw[16:]
    yield "version=7", lambda: raw[:4] + struct.pack("<I", 7) + raw[8:]
    yield "empty", lambda: b""
    yield "magic-only", lambda: raw[:4]
    for cut in (7, 24, 1000, src.kv_end - 3, src.ti_end - 5, src.data_offset + 10, len(raw) - 1):
        yield f"truncate@{cut}", lambda cut=cut: raw[:cut]


# chat templates from a model file: a syntax error, a loop of 10^10 steps, gigabytes out
TEMPLATES = {
    "syntax": "{% if %}{{ x",
    "loop": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "huge": "{% for a in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
}


def variants(src: Source, n: int, seed: int):
    """(name, targeted, bytes) triples, one at a time: the targeted corruptions first, then
    random ones (byte flips, zeroed and 0xff words in the header, truncations)."""
    rng = np.random.default_rng(seed)
    made = 0
    for name, make in targeted(src):
        if made == n:
            return
        yield name, True, make()
        made += 1
    raw = src.raw
    i = 0
    while made < n:
        made += 1
        kind = rng.choice(["flip", "truncate", "zero", "ff"])
        if kind == "truncate":
            cut = int(rng.integers(0, len(raw)))
            yield f"rand-truncate@{cut}", False, raw[:cut]
            continue
        b = bytearray(raw[:src.data_offset + 4096])
        lo, hi = 8, src.ti_end  # the header: where llama.cpp's loader reads values
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(lo, hi))
            if kind == "flip":
                b[pos] ^= 1 << int(rng.integers(0, 8))
            else:
                b[pos:pos + 4] = (b"\0" if kind == "zero" else b"\xff") * 4
        yield f"rand-{kind}-{i}", False, bytes(b) + raw[src.data_offset + 4096:]
        i += 1


def classify(r: subprocess.CompletedProcess | None, targeted: bool = False) -> str:
    if r is None:
        return "hang"
    if r.returncode < 0 or r.returncode in (134, 139):
        return "abort"
    if "Traceback (most recent call last)" in r.stderr:
        return "traceback"
    if r.returncode == 0:
        return "accepted" if targeted else "ok"
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return "error" if lines and lines[0].startswith("error:") else "unclear"


def run_variant(cli: list[str], path: Path, timeout: float) -> subprocess.CompletedProcess | None:
    env = dict(os.environ, COLUMNS="400")  # one message, one line
    try:
        return subprocess.run([*cli, "generate", str(path), "-p", "hi", "-n", "4"], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def fuzz(model: Path, n: int, seed: int, timeout: float = 60.0, log=None) -> Counter:
    src = Source(model)
    cli = [sys.executable, "-m", "specee_cpp.cli"]
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="specee-fuzz-") as tmp:
        path = Path(tmp) / "variant.gguf"
        for name, targeted, data in variants(src, n, seed):
            path.write_bytes(data)
            del data
            r = run_variant(cli, path, timeout)
            outcome = classify(r, targeted)
            counts[outcome] += 1
            if log is not None:
                detail = "" if r is None else (r.stderr.strip().splitlines() or [""])[-1][:160]
                log(f"{outcome:9s} {name}: {detail}")
    return counts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF path or a registry name")
    ap.add_argument("--n", type=int, default=253)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("-v", "--verbose", action="store_true")
    ns = ap.parse_args(argv)
    model = Path(ns.model)
    if not model.is_file():
        from specee_cpp.models.pull import pull
        from specee_cpp.models.registry import load_registry

        model = pull(load_registry().get(ns.model))
    counts = fuzz(model, ns.n, ns.seed, ns.timeout,
                  log=(lambda m: print(m, flush=True)) if ns.verbose else None)
    print(json.dumps(dict(counts)))
    bad = sum(counts[k] for k in ("traceback", "abort", "hang", "unclear", "accepted"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

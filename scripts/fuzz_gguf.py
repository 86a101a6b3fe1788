#!/usr/bin/env python3
"""Fuzz model loading with corrupted copies of a real GGUF, and count what happens.

Each variant of the source file (truncations, byte flips in the header, absurd counts,
headers rebuilt with bad hyperparameter values, nested arrays, a broken chat template) is
given to ``specee-cpp generate FILE -p hi -n 4`` in a child process. Outcomes:

- ok:        exit 0 (the corruption hit something harmless, e.g. a token's text)
- error:     exit 1 with a one-line ``error:`` message (what we want for a bad file)
- traceback: a Python traceback (a bug: an exception we did not turn into an error)
- abort:     killed by a signal (SIGABRT from GGML_ASSERT, SIGSEGV): the bug class to remove
- hang:      no answer within the timeout

    python scripts/fuzz_gguf.py MODEL.gguf --n 253 --seed 0      # the full run
    python scripts/fuzz_gguf.py smollm2-135m --n 40               # a registry name works too

Exit 0 when no variant gave a traceback, an abort or a hang. Runs in the project's venv.
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

U32, I32, F32, STR, ARR = 4, 5, 6, 8, 9


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


def variants(src: Source, n: int, seed: int):
    """(name, bytes) pairs: a fixed list of targeted corruptions, then random ones."""
    rng = np.random.default_rng(seed)
    arch = "llama"
    raw = src.raw
    fixed: list[tuple[str, bytes]] = []

    def u32(key, v):
        return _enc_kv(key, U32, struct.pack("<I", v))

    def f32(key, v):
        return _enc_kv(key, F32, struct.pack("<f", v))

    def s(key, v):
        return _enc_kv(key, STR, _enc_str(v))

    for v in (0, 1000, 2**32 - 1):
        fixed.append((f"block_count={v}",
                      src.rebuild({f"{arch}.block_count": u32(f"{arch}.block_count", v)})))
    fixed.append(("block_count=str",
                  src.rebuild({f"{arch}.block_count": s(f"{arch}.block_count", "thirty")})))
    for v in (math.nan, -1.0, math.inf, 0.0):
        key = f"{arch}.attention.layer_norm_rms_epsilon"
        fixed.append((f"eps={v}", src.rebuild({key: f32(key, v)})))
    for v in (math.nan, 0.0, -1.0, math.inf):
        key = f"{arch}.rope.freq_base"
        fixed.append((f"freq_base={v}", src.rebuild({key: f32(key, v)})))
    for v in (0, 1, 3):
        fixed.append((f"alignment={v}", src.rebuild({}, [u32("general.alignment", v)])))
    fixed.append(("alignment=str", src.rebuild({}, [s("general.alignment", "32")])))
    for v in ("bert", "t5", "nonsense"):
        fixed.append((f"tokenizer={v}",
                      src.rebuild({"tokenizer.ggml.model": s("tokenizer.ggml.model", v)})))
    for key in ("embedding_length", "attention.head_count", "context_length"):
        k = f"{arch}.{key}"
        fixed.append((f"{key}=0", src.rebuild({k: u32(k, 0)})))
        fixed.append((f"{key}=str", src.rebuild({k: s(k, "x")})))
    nested = struct.pack("<I", ARR) + b"".join(struct.pack("<IQ", ARR, 1) for _ in range(3000))
    nested += struct.pack("<IQ", U32, 1) + struct.pack("<I", 7)
    fixed.append(("nested-arrays-3000", src.rebuild({}, [_enc_kv("x.nested", ARR, nested[4:])])))
    huge = _enc_kv("x.huge", ARR, struct.pack("<IQ", U32, 2**63))
    fixed.append(("array-count-2^63", src.rebuild({}, [huge])))
    bad_template = s("tokenizer.chat_template", "{% if %}{{ x")
    fixed.append(("chat-template-syntax", src.rebuild({"tokenizer.chat_template": bad_template})))
    fixed.append(("no-architecture", src.rebuild({"general.architecture": None})))
    fixed.append(("n_kv=2^63", raw[:16] + struct.pack("<Q", 2**63) + raw[24:]))
    fixed.append(("n_tensors=2^40", raw[:8] + struct.pack("<Q", 2**40) + raw[16:]))
    fixed.append(("n_tensors=0", raw[:8] + struct.pack("<Q", 0) + raw[16:]))
    fixed.append(("version=7", raw[:4] + struct.pack("<I", 7) + raw[8:]))
    fixed.append(("empty", b""))
    fixed.append(("magic-only", raw[:4]))
    for cut in (7, 24, 1000, src.kv_end - 3, src.ti_end - 5, src.data_offset + 10, len(raw) - 1):
        fixed.append((f"truncate@{cut}", raw[:cut]))
    out = fixed[:n]
    i = 0
    while len(out) < n:
        kind = rng.choice(["flip", "truncate", "zero", "ff"])
        b = bytearray(raw[:src.data_offset + 4096])
        if kind == "truncate":
            cut = int(rng.integers(0, len(raw)))
            out.append((f"rand-truncate@{cut}", raw[:cut]))
            continue
        lo, hi = 8, src.ti_end  # the header: where llama.cpp's loader reads values
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(lo, hi))
            if kind == "flip":
                b[pos] ^= 1 << int(rng.integers(0, 8))
            else:
                b[pos:pos + 4] = (b"\0" if kind == "zero" else b"\xff") * 4
        out.append((f"rand-{kind}-{i}", bytes(b) + raw[src.data_offset + 4096:]))
        i += 1
    return out


def classify(r: subprocess.CompletedProcess | None) -> str:
    if r is None:
        return "hang"
    if r.returncode < 0 or r.returncode in (134, 139):
        return "abort"
    if "Traceback (most recent call last)" in r.stderr:
        return "traceback"
    if r.returncode == 0:
        return "ok"
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
        for name, data in variants(src, n, seed):
            path.write_bytes(data)
            r = run_variant(cli, path, timeout)
            outcome = classify(r)
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
    bad = counts["traceback"] + counts["abort"] + counts["hang"] + counts["unclear"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

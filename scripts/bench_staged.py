#!/usr/bin/env python3
"""Benchmark of the staged-decode patch (probes, mid-decode exit) on a real model.

Measures single-token decode time, interleaving configurations round by round so that drift
on a shared machine hits all of them alike, and reports each as a ratio to plain decoding
measured in the same run:

  stock         llama_decode in the unpatched llama-cpp-python build (separate process)
  patched       llama_decode in our build (separate process, same code as stock)
  staged-full   our staged decode run to the end in one segment
  probes-8      8 segments with 4 candidate probes each, no exit
  exit-L        exit at layer L (K/V of the skipped layers filled), with and without the head

    python scripts/bench_staged.py --model qwen2.5-coder-1.5b --tokens 64 --rounds 3

Writes a markdown table (with this command) into docs/BENCHMARKS.md and the raw numbers
as JSON next to it. Run it from the project's venv.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from _report import TAG_HELP, tagged, tagged_file, write_section

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n" * 4
PROBE_LAYERS_28 = [13, 15, 17, 19, 21, 23, 25, 26]
EXIT_LAYERS_28 = [8, 14, 20, 24, 27]


# ---- plain decode through llama_cpp only (runs against stock or patched libllama) ----------

def plain_child(model: str, n_tokens: int, threads: int) -> None:
    """Print {seconds per token of plain single-token decodes, sha256 of the prompt's logits}."""
    import hashlib

    import numpy as np
    from llama_cpp import llama_cpp as ll

    quiet = ll.llama_log_callback(lambda *a: None)  # kept referenced while the lib may call it
    ll.llama_log_set(quiet, None)
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    model_p = ll.llama_model_load_from_file(model.encode(), mp)
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 1024, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model_p, cp)
    vocab = ll.llama_model_get_vocab(model_p)
    data = PROMPT.encode()
    toks = (ll.llama_token * 512)()
    n = ll.llama_tokenize(vocab, data, len(data), toks, 512, True, False)
    batch = ll.llama_batch_init(512, 0, 1)

    def run(tokens, pos0):
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        assert ll.llama_decode(ctx, batch) == 0

    run(list(toks[:n]), 0)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    digest = hashlib.sha256(logits.tobytes()).hexdigest()
    run([toks[1]], n)  # warm-up of the single-token graph
    mem = ll.llama_get_memory(ctx)
    ll.llama_memory_seq_rm(mem, 0, n, -1)
    t0 = time.perf_counter()
    for i in range(n_tokens):
        run([toks[i % n]], n + i)
    print(json.dumps({"s_per_token": (time.perf_counter() - t0) / n_tokens, "logits": digest}))


def lib_dir_of_wheel(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("llama_cpp/lib/"):
                zf.extract(name, dest)
    return dest / "llama_cpp" / "lib"


def build(stock: bool) -> Path:
    cmd = ([sys.executable, str(REPO / "scripts" / "build_wheel.py")]
           + (["--stock"] if stock else []))
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def plain_in_subprocess(lib: Path, model: str, n_tokens: int, threads: int) -> dict:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib))
    out = subprocess.run([sys.executable, __file__, "--plain-child", "--model", model,
                          "--tokens", str(n_tokens), "--threads", str(threads)],
                         env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---- staged configurations through our bindings --------------------------------------------

def staged_configs(n_layer: int) -> dict:
    scale = n_layer / 28
    probes = sorted({min(n_layer - 2, round(l * scale)) for l in PROBE_LAYERS_28})
    exits = sorted({min(n_layer - 1, round(l * scale)) for l in EXIT_LAYERS_28})
    cfg = {"plain": ("plain", None), "staged-full": ("segments", [n_layer]),
           "probes-8": ("segments", probes + [n_layer])}
    for l in exits:
        cfg[f"exit-{l}+head"] = ("exit", (l, True))
        cfg[f"exit-{l}"] = ("exit", (l, False))
    return cfg


def time_staged(ctx, seq_tokens, kind, arg, n_tokens, cand) -> float:
    from specee_cpp.bindings import Batch

    b = Batch(1)
    n = len(seq_tokens)
    t0 = time.perf_counter()
    for i in range(n_tokens):
        b.set([seq_tokens[i % n]], n + i)
        if kind == "plain":
            ctx.decode(b)
        elif kind == "segments":
            ctx.stage_begin(b)
            for il in arg:
                ctx.stage_run(il, cand)
        else:
            layer, head = arg
            ctx.stage_begin(b)
            ctx.stage_run(layer, cand)
            ctx.stage_exit(full_head=head)
    dt = (time.perf_counter() - t0) / n_tokens
    ctx.seq_rm(n)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    ap.add_argument("--tag", default="", help=TAG_HELP)
    ns = ap.parse_args()

    from specee_cpp.models.registry import resolve_model
    model = str(resolve_model(ns.model))
    if ns.plain_child:
        plain_child(model, ns.tokens, ns.threads)
        return 0

    import numpy as np
    from specee_cpp.bindings import Context, Model
    from specee_cpp.engine.sequence import Sequence

    tmp = Path(tempfile.mkdtemp(prefix="specee-bench-"))
    libs = {"stock": lib_dir_of_wheel(build(stock=True), tmp / "stock"),
            "patched": lib_dir_of_wheel(build(stock=False), tmp / "patched")}

    m = Model(model)
    ctx = Context(m, n_ctx=1024, n_batch=512, n_threads=ns.threads)
    seq = Sequence(ctx)
    prompt = m.tokenize(PROMPT)
    seq.prefill(prompt)
    cand = np.array([[prompt[1], prompt[2], prompt[3], prompt[4]]], dtype=np.int32)
    configs = staged_configs(m.n_layer)
    times: dict[str, list[float]] = {k: [] for k in ["stock", "patched", *configs]}
    digests: dict[str, set] = {k: set() for k in libs}
    for r in range(ns.rounds):
        for name, lib in libs.items():
            got = plain_in_subprocess(lib, model, ns.tokens, ns.threads)
            times[name].append(got["s_per_token"])
            digests[name].add(got["logits"])
        for name, (kind, arg) in configs.items():
            times[name].append(time_staged(ctx, seq.tokens, kind, arg, ns.tokens, cand))
        print(f"round {r + 1}/{ns.rounds} done", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in times.items()}
    cmd = "python scripts/bench_staged.py " + " ".join(sys.argv[1:])
    rows = ["| configuration | ms/token | ratio to plain |", "|---|---|---|"]
    rows.append(f"| stock llama_decode (unpatched build) | {med['stock'] * 1e3:.2f} | "
                f"{med['stock'] / med['patched']:.3f} of patched |")
    for k in times:
        if k == "stock":
            continue
        base = med["patched"] if k == "patched" else med["plain"]
        rows.append(f"| {k} | {med[k] * 1e3:.2f} | {med[k] / base:.3f} |")
    identical = digests["stock"] == digests["patched"] and len(digests["stock"]) == 1
    rows.append(f"\nPrompt logits of stock and patched `llama_decode` bit-identical: "
                f"{'yes' if identical else 'NO'} (sha256 {sorted(digests['patched'])[0][:12]}).")
    table = "\n".join(rows)
    print(table)
    if not ns.no_write:
        write_report(cmd, table, times, m, ns)
    return 0


def write_report(cmd: str, table: str, times: dict, m, ns) -> None:
    docs = REPO / "docs"
    raw = tagged_file("bench_staged", ns.tag)
    (docs / raw).write_text(json.dumps(
        {"command": cmd, "model": str(m.path), "n_layer": m.n_layer, "threads": ns.threads,
         "tokens": ns.tokens, "rounds": ns.rounds, "seconds_per_token": times}, indent=1))
    write_section(tagged("Staged decode (patch 0002): probes and early exit", ns.tag),
                  f"`{cmd}` on {m.path.name} ({m.n_layer} layers), {ns.threads} threads, "
                  f"{ns.tokens} single-token decodes per configuration and round, median of "
                  f"{ns.rounds} interleaved rounds; `plain` and the staged rows run in one process "
                  f"on the patched build, `patched` and `stock` in separate processes with the "
                  f"same code. Raw numbers: `docs/{raw}`.\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a verification batch's cost goes: the LM head against the rest of the model.

Greedy verification of n drafted tokens decodes them in one batch and reads an output row
for every one of them; a prefill reads only the last. Timing the same n-token batch both
ways, interleaved in one process after a 128-token context, separates what the n-1 extra
output rows cost (the LM head, ``output.weight``, plus the argmax read in C) from the body
(attention and MLP of every layer). Both are given in target tokens (a plain greedy step
in the same run). Beside them, the target's weights by quantization type: on x86 llama.cpp
(this pinned version) repacks Q4_0, Q4_K, IQ4_NL and (with AVX-512) Q2_K for batched
multiplication and its llamafile sgemm covers F16/BF16/Q8_0/Q4_0/Q5_0/IQ4_NL; Q6_K has
neither, so below 8 rows a Q6_K matrix costs about n single-row products for an n-row
batch; from 8 rows it takes ggml-cpu's tiled K-quant path, which on the 2-core EPYC loses
to the row products up to 12 rows and wins from 13 (scripts/verify_curve.py).

    python scripts/verify_cost_probe.py [--targets qwen2.5-coder-1.5b,qwen2.5-coder-1.5b:Q4_0]
                                        [--repeats 9] [--no-write]

Writes docs/bench/verify-cost-probe.json and a section of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCHES = (1, 2, 4, 8, 12, 15, 16)


def weights_by_type(path: Path) -> tuple[dict[str, int], str, str]:
    """Weights per quantization type over the matrices a token multiplies, and the head's
    tensor name and type (``output.weight``, or the tied ``token_embd.weight``)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    by_name = {t.name: t for t in r.tensors}
    head = by_name.get("output.weight") or by_name["token_embd.weight"]
    counts: Counter = Counter()
    for t in r.tensors:
        # the input embedding is a row lookup, not a product (unless it is the tied head)
        if t.name == "token_embd.weight" and t is not head or len(t.shape) < 2:
            continue
        counts[t.tensor_type.name] += int(t.n_elements)
    return dict(counts), head.name, head.tensor_type.name


def probe(target: str, context: int, repeats: int, cfg, batches=BATCHES) -> dict:
    """Medians, in plain greedy tokens, of an n-token batch with every output row read and
    with the last only, for each n in BATCHES."""
    from specee_cpp.engine.llm import LLM, resolve

    path = resolve(target)
    types, head_name, head_type = weights_by_type(path)
    clock = time.perf_counter
    with LLM(target, config=cfg) as llm:
        seq = llm.tgt.seq
        base = llm.prompt_tokens("Write a function that parses a date and explain it.")
        ctx = (base * (context // len(base) + 1))[:context]
        filler = (base * (max(batches) // len(base) + 1))[:max(batches)]
        seq.prefill(ctx, read=False)
        n0 = len(seq.tokens)

        def plain() -> float:
            t0 = clock()
            for t in filler[:4]:
                seq.decode([t])
                seq.argmax()
            dt = (clock() - t0) / 4
            seq.rewind(n0)
            return dt

        def batch(n: int, all_rows: bool) -> float:
            t0 = clock()
            if all_rows:
                seq.decode_greedy(filler[:n])
            else:
                seq.decode(filler[:n])
                seq.argmax()
            dt = clock() - t0
            seq.rewind(n0)
            return dt

        for n in batches:   # warm-up: every graph shape once
            batch(n, True)
            batch(n, False)
        runs: dict = {"plain": []}
        runs.update({(n, a): [] for n in batches for a in (True, False)})
        for r in range(repeats):
            print(f"\r{target}: repeat {r + 1}/{repeats}", end="", file=sys.stderr, flush=True)
            runs["plain"].append(plain())
            for n in batches:
                # alternate which goes first, so drift does not favour one
                for a in ((True, False) if r % 2 == 0 else (False, True)):
                    runs[(n, a)].append(batch(n, a))
        print(file=sys.stderr)

    med = {k: statistics.median(v) for k, v in runs.items()}
    p = med["plain"]
    rows = []
    for n in batches:
        full, last = med[(n, True)] / p, med[(n, False)] / p
        rows.append({"n": n, "all_rows": round(full, 3), "last_row": round(last, 3),
                     "head_rows_extra": round(full - last, 3),
                     "per_extra_row": round((full - last) / (n - 1), 3) if n > 1 else None})
    total = sum(types.values())
    return {"target": target, "file": path.name, "plain_token_ms": round(p * 1e3, 2),
            "head": {"tensor": head_name, "type": head_type},
            "weights_by_type": {k: round(v / total, 4) for k, v in sorted(types.items())},
            "batches": rows}


def table(r: dict) -> list[str]:
    lines = [f"`{r['target']}` ({r['file']}): plain greedy token {r['plain_token_ms']} ms "
             f"= 1.00; LM head `{r['head']['tensor']}` is {r['head']['type']}; the weights a "
             "token multiplies, by type: "
             + ", ".join(f"{k} {v:.1%}" for k, v in r["weights_by_type"].items()) + ".", "",
             "| batch n | all n rows read (verify) | last row only | extra rows' head | "
             "per extra row |", "|---:|---:|---:|---:|---:|"]
    for row in r["batches"]:
        per = "" if row["per_extra_row"] is None else f"{row['per_extra_row']:.3f}"
        lines.append(f"| {row['n']} | {row['all_rows']:.2f} | {row['last_row']:.2f} | "
                     f"{row['head_rows_extra']:.2f} | {per} |")
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="qwen2.5-coder-1.5b,qwen2.5-coder-1.5b:Q4_0",
                    help="comma-separated; NAME:TYPE variants are made once and cached")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="batch sizes, comma-separated (the cost table stops at 16; larger "
                         "ones show what longer drafts would cost)")
    ap.add_argument("--no-write", action="store_true")
    sys.path.insert(0, str(REPO / "scripts"))
    from _report import TAG_HELP, tagged, tagged_file, write_section

    ap.add_argument("--tag", default="", help=TAG_HELP)
    ns = ap.parse_args()

    from specee_cpp.config import LoadConfig
    from specee_cpp.provenance import describe, machine

    cfg = LoadConfig()
    m = machine(cfg.threads)
    batches = tuple(int(b) for b in ns.batches.split(","))
    results = [probe(t.strip(), ns.context, ns.repeats, cfg, batches)
               for t in ns.targets.split(",") if t.strip()]
    report = {"command": "python scripts/verify_cost_probe.py " + " ".join(sys.argv[1:]),
              "context": ns.context, "repeats": ns.repeats, "machine": m, "targets": results}
    lines = [f"Command: `{report['command']}` ({describe(m)}).", "",
             f"{ns.context} tokens of context, medians of {ns.repeats} repeats interleaved "
             "(all rows / last row alternating first). Cells in plain greedy tokens of the "
             "same target in the same run.", ""]
    for r in results:
        lines += table(r)
    text = "\n".join(lines).rstrip() + "\n"
    print(text)
    if not ns.no_write:
        out = REPO / "docs" / "bench" / tagged_file("verify-cost-probe", ns.tag)
        out.write_text(json.dumps(report, indent=1) + "\n")
        write_section(tagged("Verification cost: the LM head against the body", ns.tag), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

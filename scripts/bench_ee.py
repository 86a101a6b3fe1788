#!/usr/bin/env python3
"""Early exit (SpecEE) against plain decoding, on prompts held out from calibration.

For each prompt the configurations run one after the other (interleaved prompt by prompt,
so drift on a shared machine hits all alike); speed is reported as a ratio to plain
decoding in the same run. Quality: the fraction of outputs identical to plain's, their
common prefix, and teacher-forced agreement (each emitted token compared with the full
model's greedy token after the same prefix, one batched full-depth pass).

    python scripts/bench_ee.py --n-prompts 24 --max-tokens 64

Writes a table (with this command) into docs/BENCHMARKS.md and raw numbers to
docs/bench_ee.json. The calibration prompts (the ones `specee-cpp calibrate --n-prompts N`
picks) are excluded from the evaluation set.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _report import ee_configs, write_section

import numpy as np

from specee_cpp.engine.sequence import common_prefix

REPO = Path(__file__).resolve().parent.parent
DEV = REPO / "specee_cpp" / "data" / "spec_bench_dev.jsonl"  # the dev half, shipped


def held_out(texts: list[str], n_calib: int, n: int) -> list[int]:
    from specee_cpp.ee.calibrate import spread

    calib = set(spread(len(texts), n_calib)) if n_calib else set()
    rest = [i for i in range(len(texts)) if i not in calib]
    return [rest[j * len(rest) // n] for j in range(min(n, len(rest)))]


def agreement(llm, prompt_tokens: list[int], out: list[int]) -> float:
    """Teacher-forced: fraction of out[i] equal to the full model's argmax after out[:i]
    (one batched full-depth pass; for plain itself this shows the batching noise floor)."""
    if not out:
        return 1.0
    seq = llm.tgt.seq
    preds = [int(np.argmax(seq.prefill(prompt_tokens)))]
    if len(out) > 1:
        preds += [int(np.argmax(row)) for row in seq.feed(out[:-1], all_logits=True)]
    return float(np.mean([p == t for p, t in zip(preds, out)]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default=str(DEV))
    ap.add_argument("--n-prompts", type=int, default=24)
    ap.add_argument("--calib-prompts", type=int, default=64,
                    help="--n-prompts of the calibration run, excluded here")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="plain,ee-draft,ee-ngram")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--from-json", help="re-render the tables of an earlier run's JSON")
    ns = ap.parse_args()
    if ns.from_json:
        import shlex

        doc = json.loads(Path(ns.from_json).read_text())
        old = ap.parse_args(shlex.split(doc["command"])[2:])
        old.no_write = ns.no_write
        names = [k for k in doc["raw"][0] if k != "prompt_index"]
        report_and_write(doc["raw"], names, categories_of(Path(old.prompts)), old,
                         doc["prompt_indices"], doc["command"])
        return 0

    from specee_cpp.config import LoadConfig
    from specee_cpp.ee.calibrate import load_prompts
    from specee_cpp.engine.llm import LLM

    texts = load_prompts(Path(ns.prompts))
    idx = held_out(texts, ns.calib_prompts, ns.n_prompts)
    configs = ee_configs(ns.configs)
    names = list(configs)
    raw = []
    with LLM(ns.model, draft=ns.draft, config=LoadConfig(n_ctx=2048, n_threads=ns.threads)) as llm:
        llm.generate(texts[idx[0]], max_tokens=8)  # warm-up, discarded
        for j, i in enumerate(idx):
            ptoks = llm.prompt_tokens(texts[i])
            row = {"prompt_index": i}
            for name in names:
                mode, ee = configs[name]
                res = llm.generate(texts[i], max_tokens=ns.max_tokens, mode=mode, ee=ee)
                row[name] = {"tokens": res.tokens, "stats": res.stats.as_dict()}
            for name in names:
                row[name]["agreement"] = agreement(llm, ptoks, row[name]["tokens"])
            raw.append(row)
            print(f"prompt {j + 1}/{len(idx)}", file=sys.stderr)

    report_and_write(raw, names, categories_of(Path(ns.prompts)), ns, idx,
                     "python scripts/bench_ee.py " + " ".join(sys.argv[1:]))
    return 0


def categories_of(path: Path) -> list[str]:
    from specee_cpp.ee.calibrate import load_prompt_records

    return [category for category, _ in load_prompt_records(path)]


def table_for(raw: list[dict], names: list[str]) -> str:
    def total(name, key):
        return sum(r[name]["stats"][key] for r in raw)

    rows = ["| configuration | tok/s | speed vs plain | exit ratio | mean exit layer | "
            "agreement (teacher-forced) | identical to plain | common prefix | "
            "ms/token draft / layers / probe / head |", "|---|---|---|---|---|---|---|---|---|"]
    plain_tps = total("plain", "n_gen") / total("plain", "decode_s")
    for name in names:
        n_gen, dec = total(name, "n_gen"), total(name, "decode_s")
        tps = n_gen / dec
        exits = {}
        for r in raw:
            for k, v in r[name]["stats"]["exit_layers"].items():
                exits[int(k)] = exits.get(int(k), 0) + v
        n_exit = sum(exits.values())
        mean_l = f"{sum(k * v for k, v in exits.items()) / n_exit:.1f}" if n_exit else "-"
        agree = f"{np.mean([r[name]['agreement'] for r in raw]):.3f}"
        if name == "plain":
            ident = pref = "-"
        else:
            ident = f"{np.mean([r[name]['tokens'] == r['plain']['tokens'] for r in raw]):.2f}"
            pref = f"{np.mean([common_prefix(r[name]['tokens'], r['plain']['tokens']) for r in raw]):.1f}"
        split = " / ".join(f"{1e3 * sum(r[name]['stats']['timings'].get(p, 0) for r in raw) / n_gen:.1f}"
                           for p in ("draft", "layers", "probe", "head"))
        rows.append(f"| {name} | {tps:.1f} | {tps / plain_tps:.3f} | {n_exit / n_gen:.2f} | "
                    f"{mean_l} | {agree} | {ident} | {pref} | {split} |")
    return "\n".join(rows)


def category_table(raw: list[dict], names: list[str], cats: list[str]) -> str:
    """Speed vs plain per Spec-Bench category (tokens/s summed within the category)."""
    groups: dict[str, list[dict]] = {}
    for r in raw:
        groups.setdefault(cats[r["prompt_index"]], []).append(r)
    others = [n for n in names if n != "plain"]
    rows = ["| category | prompts | plain tok/s | " + " | ".join(others) + " |",
            "|---|---|---|" + "---|" * len(others)]
    for cat, rs in sorted(groups.items()):
        def tps(name):
            return sum(r[name]["stats"]["n_gen"] for r in rs) / sum(r[name]["stats"]["decode_s"] for r in rs)
        rows.append(f"| {cat} | {len(rs)} | {tps('plain'):.1f} | "
                    + " | ".join(f"{tps(n) / tps('plain'):.3f}" for n in others) + " |")
    return "\n".join(rows)


def report_and_write(raw, names, cats, ns, idx, cmd) -> None:
    table = table_for(raw, names)
    per_cat = category_table(raw, names, cats)
    print(table)
    print(per_cat)
    if not ns.no_write:
        (REPO / "docs" / "bench_ee.json").write_text(json.dumps(
            {"command": cmd, "names": names, "args": vars(ns), "prompt_indices": idx,
             "raw": raw}, indent=None))
        section = (f"Early exit (SpecEE) vs plain, held-out Spec-Bench dev prompts\n\n"
                   f"`{cmd}`: {len(idx)} prompts of `spec_bench_dev.jsonl` not used by the "
                   f"calibration (`--n-prompts {ns.calib_prompts}`), chat template, greedy, "
                   f"{ns.max_tokens} new tokens, {ns.threads} threads, configurations "
                   f"interleaved prompt by prompt; decode tokens/s over all prompts. Raw: "
                   f"`docs/bench_ee.json`. {time.strftime('%Y-%m-%d')}.\n\n{table}\n\n"
                   f"Speed vs plain by category (same run):\n\n{per_cat}\n")
        write_section(*section.split("\n\n", 1))


if __name__ == "__main__":
    sys.exit(main())

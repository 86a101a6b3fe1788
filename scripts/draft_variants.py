#!/usr/bin/env python3
"""Draft variants for this machine's kernels: cost and acceptance of each cheaper draft.

For each variant of the draft (`NAME:TYPE` requantized with llama.cpp's quantizer,
`NAME:vN` with its LM head cut to the N most frequent tokens, or `NAME:TYPE:vN`; made once
and cached),
this measures the cost table against the target (`specee-cpp costs`: a draft token in
target tokens, verification of 2/4/8) and runs `specee-cpp bench` with a fixed draft length
on held-out dev prompts for the acceptance, writes the acceptance record `NAME:auto` reads
and prints one table with this command. A cheaper draft pays only where verification is
cheap enough too: the table says which side stops drafting on this machine.

    python scripts/draft_variants.py --variants Q4_K_M,v32k,v16k,v8k,IQ4_NL,IQ4_NL:v16k

Another machine adds its measurements with ``--merge --tag NAME``: the variants measured
there replace theirs in the record (each variant keeps where it was measured), the others
stay, and its records and table are named apart (``docs/bench/draft-*-NAME``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variants", "--types", default="Q4_K_M,Q4_0,IQ4_NL,Q8_0",
                    help="draft variants: TYPE, vN (reduced head) or TYPE:vN; the registry "
                         "file's own type is the draft as shipped")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="keep the record's variants not measured now (another machine's)")
    ap.add_argument("--tag", default="",
                    help="suffix of this run's records (a machine)")
    ap.add_argument("--fresh", action="store_true",
                    help="measure acceptance again (default: reuse docs/bench/draft-*.jsonl "
                         "records of this machine and build)")
    ns = ap.parse_args()

    from specee_cpp.bench.suite import BenchOptions, run
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.paths import write_text_atomic
    from specee_cpp.models.registry import load_registry
    from specee_cpp.provenance import describe
    from specee_cpp.speculative.mode import cost_model

    shipped = load_registry().get(ns.draft).quant
    rows, where, accepted = [], None, {}
    suffix = f"-{ns.tag}" if ns.tag else ""
    for qtype in ns.variants.split(","):
        name = ns.draft if qtype == shipped else f"{ns.draft}:{qtype}"
        print(f"[variants] {name}: costs", file=sys.stderr)
        with LLM(ns.target, draft=name, config=LoadConfig()) as llm:
            table = cost_model(llm)
            mb = llm.draft_path.stat().st_size / 2**20
            n_head = llm.dft.model.n_head or llm.dft.model.n_vocab
            # a reduced head's file name carries its ranking's digest: which head was measured
            file_name = llm.draft_path.name
        c = table.points[0]
        v1, where = c.plain, table.machine
        print(f"[variants] {name}: acceptance (spec-{ns.gamma})", file=sys.stderr)
        out = REPO / "docs" / "bench" / f"draft-{qtype.replace(':', '-')}{suffix}"
        s = run(BenchOptions(model=ns.target, draft=name, configs=f"spec-{ns.gamma}",
                             per_category=ns.per_category, max_tokens=ns.max_tokens,
                             max_prompt_tokens=256, out=str(out), fresh=ns.fresh))
        e = s["configs"][f"spec-{ns.gamma}"]
        accepted[qtype] = {"acceptance": round(e["acceptance"] or 0.0, 4), "gamma": ns.gamma,
                           "drafted": e.get("n_drafted"), "prompts": e.get("prompts"),
                           "draft_token_ratio_where_measured": round(c.draft_token_s / v1, 3),
                           "file": file_name}
        best = max(range(1, 9), key=lambda g: c.expected_tps(e["acceptance"] or 0, g))
        rows.append(f"| {qtype}{' (shipped)' if qtype == shipped else ''} | {mb:.0f} | "
                    f"{n_head} | "
                    f"{c.draft_token_s / v1:.2f} | "
                    + " / ".join(f"{c.verify(n) / v1:.2f}" for n in (2, 4, 8))
                    + f" | {e['acceptance']:.3f} | {e['speedup']:.3f} | "
                    f"{c.expected_tps(e['acceptance'] or 0, best) * v1:.2f} (gamma {best}) |")
    head = ("| draft variant | MiB | head rows | draft token / target token | verify 2 / 4 / 8 | "
            f"acceptance (gamma {ns.gamma}) | spec-{ns.gamma} vs plain (measured) | "
            "best predicted vs plain |")
    table_md = "\n".join([head, "|---|---|---|---|---|---|---|---|", *rows])
    print(table_md)
    if not ns.no_write:
        cmd = "python scripts/draft_variants.py " + " ".join(sys.argv[1:])
        # what `--draft NAME:auto` chooses from (speculative/variants.py): acceptance is the
        # models' (dev prompts); every machine measures its own costs
        from specee_cpp.models.pull import file_sha256
        from specee_cpp.models.registry import resolve_model
        from specee_cpp.speculative.variants import record_path

        rec = record_path(file_sha256(resolve_model(ns.draft)))
        data = {"format": 1, "draft": ns.draft, "shipped": shipped, "target": ns.target,
                "variants": accepted, "source": cmd,
                "split": "held-out Spec-Bench dev prompts (dev data)",
                "measured_on": describe(where), "date": time.strftime("%Y-%m-%d")}
        # acceptance differs by machine (batched arithmetic changes the greedy text), so a
        # variant is compared with the shipped draft measured in the same run
        if shipped in accepted and accepted[shipped]["acceptance"]:
            for v in accepted.values():
                v["relative_to_shipped"] = round(v["acceptance"]
                                                 / accepted[shipped]["acceptance"], 4)
        if ns.merge and rec.is_file():
            # each variant says where it was measured: this run's, and the earlier ones
            # under the record's own provenance
            old = json.loads(rec.read_text(encoding="utf-8"))
            here = {"source": cmd, "measured_on": data["measured_on"], "date": data["date"]}
            there = {k: old[k] for k in ("source", "measured_on", "date") if k in old}
            old_v = old.get("variants", {})
            old_ref = old_v.get(shipped, {}).get("acceptance")
            merged = {q: {**there, **v} for q, v in old_v.items() if q not in accepted}
            for v in merged.values():
                if old_ref and "relative_to_shipped" not in v:
                    v["relative_to_shipped"] = round(v["acceptance"] / old_ref, 4)
            merged.update({q: {**v, **here} for q, v in accepted.items()})
            data = {**old, "variants": merged, "source": "per variant",
                    "measured_on": "per variant", "date": data["date"]}
        write_text_atomic(rec, json.dumps(data, indent=1) + "\n")
        print(f"`{cmd}`: each variant made from the shipped "
              f"{ns.draft} ({shipped}): `TYPE` with llama.cpp's quantizer, `vN` with "
              f"the LM head cut to the N most frequent tokens (FR-Spec; ranking "
              f"from `scripts/head_vocab.py`, dev data + code corpus); costs "
              f"from `specee-cpp costs` (128-token context, target "
              f"{ns.target}); acceptance and measured speed from `specee-cpp bench "
              f"--configs spec-{ns.gamma} --per-category {ns.per_category} "
              f"--max-prompt-tokens 256` (held-out dev prompts, {ns.max_tokens} "
              f"tokens, its own plain in the same run; records "
              f"`docs/bench/draft-*{suffix}.json`). Best predicted: the cost model's best "
              f"gamma at that acceptance. Measured on {describe(where)}; "
              f"{time.strftime('%Y-%m-%d')}.\n\n{table_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

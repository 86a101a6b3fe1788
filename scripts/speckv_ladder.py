#!/usr/bin/env python3
"""The draft-length controller over the quantization ladder, end to end:

1. quantize the target to each level (`specee-cpp quantize`, cached in the model cache);
2. profile every level with the draft on dev prompts (`specee-cpp profile`: the fitting
   pool of `calibrate`, 2 prompts per Spec-Bench task, gamma 1,2,3,4,6,8);
3. fit the controller on all levels (`specee-cpp fit-controller`), shipped in
   specee_cpp/bundles/;
4. simulate every policy by replaying the profiled rounds (cross-fitted: each prompt's
   rounds are replayed by a controller fitted without that prompt) with this machine's
   measured costs per level and with a GPU-like cost shape (a table on stdout);
5. optionally (--measure) run `specee-cpp bench` per level on held-out prompts with the
   fixed gammas, the baselines and ours (a table on stdout; records in docs/bench/).

Every step skips what is already there, so an interrupted run resumes.

    python scripts/speckv_ladder.py --types Q8_0,Q4_K_M,IQ4_NL,Q3_K_M,Q2_K [--measure]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "controller"
POLICIES = ["0", "2", "4", "6", "8", "pmin", "hf", "speckv", "auto", "stop"]
MEASURED = ["plain", "spec-2", "spec-4", "spec-6", "spec-8", "spec-pmin", "spec-hf",
            "spec-speckv", "spec-auto", "spec-stop"]


def cli(*args: str) -> None:
    cmd = [str(Path(sys.executable).with_name("specee-cpp")), *args]
    print("+ specee-cpp " + " ".join(args), file=sys.stderr, flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}")


def level_file(target: Path, qtype: str, source_quant: str) -> Path:
    if qtype == source_quant:
        return target
    from specee_cpp.paths import models_dir

    return models_dir() / f"{target.name.removesuffix('.gguf')}.{qtype}.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--types", default="Q8_0,Q4_K_M,IQ4_NL,Q3_K_M,Q2_K")
    ap.add_argument("--gammas", default="1,2,3,4,6,8")
    ap.add_argument("--profile-tokens", type=int, default=32)
    ap.add_argument("--measure", action="store_true", help="also run the measured bench")
    ap.add_argument("--measure-per-category", type=int, default=1)
    ap.add_argument("--measure-tokens", type=int, default=64)
    ns = ap.parse_args()

    from specee_cpp.models.gguf_info import read_gguf_info
    from specee_cpp.models.registry import resolve_model

    target = resolve_model(ns.target)
    source_quant = read_gguf_info(target).quant
    types = [t.strip().upper() for t in ns.types.split(",") if t.strip()]
    OUT.mkdir(parents=True, exist_ok=True)
    files = {}
    for t in types:
        f = level_file(target, t, source_quant)
        if not f.is_file():
            cli("quantize", str(target), "--types", t)
        files[t] = f
    profiles = []
    for t, f in files.items():
        prof = OUT / f"profile-{t}.jsonl"
        # profile's default --prompts: the dev half shipped in the package
        cli("profile", str(f), "--draft", ns.draft, "--out", str(prof),
            "--gammas", ns.gammas, "--max-tokens", str(ns.profile_tokens))
        profiles.append(prof)
    cli("fit-controller", *map(str, profiles), "--draft", ns.draft, "--target", str(target))
    simulate(files, profiles, ns)
    if ns.measure:
        measure(files, ns)
    return 0


def publish(heading: str, body: str) -> None:
    print(f"## {heading}\n\n{body}")


def command() -> str:
    return "python scripts/speckv_ladder.py " + " ".join(sys.argv[1:])


def table_head(columns: list[str]) -> tuple[str, str]:
    """A markdown table's header row and separator."""
    return "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)


def simulate(files: dict, profiles: list[Path], ns) -> None:
    """Cross-fitted replay of every policy at every level, on this machine's measured costs
    and on a GPU-like cost shape."""
    from specee_cpp.config import LoadConfig
    from specee_cpp.speculative import acceptance, policies, simulate as sim
    from specee_cpp.engine.llm import LLM
    from specee_cpp.records import records
    from specee_cpp.speculative.mode import cost_model, parse_gamma

    per_level = {}
    for (t, f), prof in zip(files.items(), profiles):
        recs = records(prof, what="profile file")
        with LLM(f, draft=ns.draft, config=LoadConfig(n_ctx=2048)) as llm:
            # the profiles' rounds run at short contexts: the table's first point
            per_level[t] = (recs, cost_model(llm).points[0], llm.model.bits_per_weight)
    all_recs = [r for recs, _, _ in per_level.values() for r in recs]
    prompt_ids = sorted({r["prompt_id"] for r in all_recs})
    folds = [prompt_ids[i::4] for i in range(4)]
    models = [acceptance.fit([r for r in all_recs if r["prompt_id"] not in set(fold)])
              for fold in folds]
    rows = {"this CPU": [], "GPU-like": []}
    for t, (recs, cpu_costs, bpw) in per_level.items():
        for machine, costs in (("this CPU", cpu_costs), ("GPU-like", sim.gpu_like(cpu_costs, bpw))):
            cells = []
            for name in POLICIES:
                tokens = seconds = drafted = rounds = 0.0
                plain_tps = None
                for fold, model in zip(folds, models):
                    part = [r for r in recs if r["prompt_id"] in set(fold)]
                    if not part:
                        continue
                    rep = sim.replay(part, lambda: policies.make_policy(
                        parse_gamma(name), model=model, costs=costs, bpw=bpw), costs)
                    tokens += rep.tokens
                    seconds += rep.seconds
                    drafted += rep.drafted
                    rounds += rep.rounds
                    plain_tps = rep.plain_tps
                cells.append(f"{tokens / seconds / plain_tps:.2f} ({drafted / rounds:.1f})")
            v1 = costs.plain
            rows[machine].append(f"| {t} | {bpw:.2f} | {costs.draft_token_s / v1:.2f} | "
                                 f"{costs.verify(5) / v1:.2f} | " + " | ".join(cells) + " |")
    overhead = decision_overhead(models[0], per_level)
    head, sep = table_head(["target", "bits/weight", "draft / target token", "verify 5 / 1"]
                           + [f"gamma {p}" if p.isdigit() else p for p in POLICIES])
    cmd = command()
    body = (f"`{cmd}`: replay of the profiled rounds (gamma-8 rounds of "
            f"`docs/controller/profile-*.jsonl`, dev prompts, {len(all_recs)} rounds in all) "
            f"under each policy; the controller policies are cross-fitted (4 folds by prompt: "
            f"each prompt is replayed by a controller fitted without it). Cell: speed vs "
            f"plain decoding (mean drafted tokens per round). Costs: this machine's measured "
            f"cost model per level, and a GPU-like shape with the same single-token time: "
            f"verify n tokens = 1 + 0.02 (n - 1) target tokens, a draft token 0.1 of a Q4_K_M "
            f"target token (larger relative to a more compressed target). Decision "
            f"overhead (this machine, mean of 2000 calls): {overhead}. "
            f"{time.strftime('%Y-%m-%d')}.\n\n"
            + "\n\n".join(f"{m}:\n\n{head}\n{sep}\n" + "\n".join(r) for m, r in rows.items()))
    publish("Draft-length controller: simulation per quantization level", body)


def decision_overhead(model, per_level: dict) -> str:
    """Microseconds per decision of our policies where they do decide (GPU-like costs)."""
    from specee_cpp.speculative import policies, simulate as sim

    recs, costs, bpw = next(iter(per_level.values()))
    gpu = sim.gpu_like(costs, bpw)
    auto = policies.CostAwareGamma(model, gpu, bpw)
    stop = policies.CostAwareStop(model, gpu, bpw)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        auto.plan()
    t1 = time.perf_counter()
    for _ in range(n):
        stop.plan()
        stop.keep(0, 0.9, 0.3)
    t2 = time.perf_counter()
    return (f"auto plan() {1e6 * (t1 - t0) / n:.0f} us, stop plan()+keep() "
            f"{1e6 * (t2 - t1) / n:.0f} us")


def measure(files: dict, ns) -> None:
    for t, f in files.items():
        cli("bench", str(f), "--draft", ns.draft, "--configs", ",".join(MEASURED),
            "--per-category", str(ns.measure_per_category), "--max-tokens",
            str(ns.measure_tokens), "--max-prompt-tokens", "256",
            "--out", str(REPO / "docs" / "bench" / f"ladder-{t}"))
    rows = []
    for t in files:
        doc = json.loads((REPO / "docs" / "bench" / f"ladder-{t}.json").read_text())
        cfg = doc["summary"]["configs"]
        fixed = max(cfg[f"spec-{g}"]["speedup"] for g in (2, 4, 6, 8))
        rows.append(f"| {t} | {cfg['plain']['tps']:.1f} | "
                    + " | ".join(f"{cfg[n]['speedup']:.3f}" for n in MEASURED[1:])
                    + f" | {cfg['spec-auto']['speedup'] / fixed:.3f} |")
    head, sep = table_head(["target", "plain tok/s", *MEASURED[1:], "ours (auto) / best fixed"])
    cmd = command()
    body = (f"`{cmd}` (step 5: `specee-cpp bench` per level, {ns.measure_per_category} "
            f"held-out prompt(s) per Spec-Bench task, {ns.measure_tokens} new tokens, user "
            f"messages over 256 tokens cut in the middle, configurations interleaved; raw "
            f"records in `docs/bench/ladder-*.json`). Decode speed vs plain in the same run. "
            f"Where the measured costs say no draft length can beat plain (every level here "
            f"but Q8_0), spec-auto and spec-stop run the very same plain decoding code as "
            f"plain: their distance from 1.000 there is this machine's run-to-run noise over "
            f"so few prompts, not a speed-up. {time.strftime('%Y-%m-%d')}.\n\n"
            f"{head}\n{sep}\n" + "\n".join(rows))
    publish("Draft-length controller: measured per quantization level", body)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fit the copy model: the acceptance of the context drafter's free drafts
(specee_cpp/speculative/context_acceptance.py), for one target, on dev prompts only.

Data: the target's plain greedy outputs (token ids, with their prompts) on
  1. the Spec-Bench dev prompts that calibration fits on (the 64-prompt fitting pool; bench
     excludes them), first turns cut to 256 tokens as bench cuts them, 64 tokens each;
  2. their second turns where they have one (MT-Bench), each in its conversation with the
     model's own plain answer to the first turn (bench's multi-turn path), 64 tokens;
  3. code edits of HumanEval dev tasks (`humaneval-edit`, every --edit-step-th of 0-81;
     bench's code-edit runs use tasks 82+), 192 tokens.
Outputs are cached under $SPECEE_CPP_HOME/copy-profile (one JSON line per prompt, so an
interrupted run resumes). Under greedy decoding every proposal's fate is fixed by the
output, so the drafter's samples and its rounds are replayed from these streams.

It prints and writes (--report) a held-out report: every fifth stream held out, log loss of
the fitted model against the drafter's built-in guess and the base rate, and the simulated
speed-up of context drafting over plain per source with this machine's cost table and a
GPU-like one (speculative/simulate.gpu_like); then fits on all streams and writes
specee_cpp/bundles/<target sha256[:16]>.copy.npz, which `--mode spec` reads.

    python scripts/fit_copy_model.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prompts(edit_step: int):
    """(prompt, max_tokens) pairs of the fitting data, in a fixed order."""
    from specee_cpp.bench.prompts import (DEV_PROMPTS, fitting_pool, load_humaneval_edit,
                                          load_spec_bench, with_turns)

    pool = with_turns(fitting_pool(load_spec_bench(DEV_PROMPTS), 64), 2)
    edits = load_humaneval_edit("0-81")[::edit_step]
    return [(p, 64) for p in pool] + [(p, 192) for p in edits]


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The target whose streams are replayed, and the draft that keys the cost table."""
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b",
                    help="only for this machine's cost table (measured once, cached)")


def add_data_args(ap: argparse.ArgumentParser) -> None:
    """The options that say which dev streams."""
    add_model_args(ap)
    ap.add_argument("--edit-step", type=int, default=2,
                    help="use every Nth HumanEval dev task (0-81) as a code edit")


def stream_cache(llm, prefix: str = "") -> Path:
    """Where the target's dev streams (``prefix``: another set of streams) are cached:
    $SPECEE_CPP_HOME/copy-profile."""
    from specee_cpp.paths import home

    return home() / "copy-profile" / f"{prefix}{llm.model.sha256[:16]}.jsonl"


def streams(llm, todo, cache: Path, log) -> list[dict]:
    """The target's plain greedy output for each prompt, with the prompt's tokens (cached)
    and the run's max_tokens (``max_tokens``: a replay drafts no further, as a run does)."""
    from specee_cpp.bench.runner import Runner
    from specee_cpp.bench.suite import shorten
    from specee_cpp.records import records

    done = {r["id"]: r for r in records(cache, what="copy profile", missing_ok=True,
                                        torn_tail=True)}
    runner = Runner(llm, [], max_tokens=0)
    runner.answers_path = cache.with_suffix(".answers.json")
    if runner.answers_path.is_file():
        runner.answers = json.loads(runner.answers_path.read_text())
    out = []
    with open(cache, "a", encoding="utf-8") as fh:
        for k, (p, n) in enumerate(todo):
            if p.id not in done:
                if not p.earlier:
                    p = shorten(p, llm.model, 256)
                convo = runner.conversation(p)
                llm.reset()
                res = llm.generate(convo, chat=p.chat, max_tokens=n, mode="plain")
                rec = {"id": p.id, "category": p.category,
                       "prompt": llm.prompt_tokens(convo, chat=p.chat), "output": res.tokens}
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                done[p.id] = rec
                log(f"{k + 1}/{len(todo)} {p.id}: {len(res.tokens)} tokens")
            out.append(dict(done[p.id], max_tokens=n))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(ap)
    ap.add_argument("--report", default=str(REPO / "docs" / "bench" / "copy-model.json"))
    ap.add_argument("--first-scale-only", action="store_true",
                    help="keep the shipped nets; only measure on the dev streams how far "
                         "they overrate an answer's first free draft (copy_model."
                         "first_guess_scale) and write that into the bundle")
    ns = ap.parse_args()

    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.provenance import describe, machine
    from specee_cpp.speculative.context_acceptance import (FEATURES, bundle_path, fit,
                                                          held_out_report)
    from specee_cpp.speculative.mode import cost_model
    from specee_cpp.speculative.simulate import gpu_like

    def log(msg: str) -> None:
        print(f"[copy-model] {msg}", file=sys.stderr, flush=True)

    with LLM(ns.target, draft=ns.draft, config=LoadConfig(n_ctx=4096)) as llm:
        sha = llm.model.sha256
        cache = stream_cache(llm)
        cache.parent.mkdir(parents=True, exist_ok=True)
        data = streams(llm, prompts(ns.edit_step), cache, log)
        eog = llm.model.eog_tokens
        if not ns.first_scale_only:   # the replay's costs (measured once per machine)
            table = cost_model(llm)
            where = machine(llm.config.threads)
            gpu = gpu_like(table.points[0], llm.model.bits_per_weight)
    if ns.first_scale_only:
        from specee_cpp.speculative.context_acceptance import CopyModel, first_guess_scale, samples

        shipped = CopyModel.load(bundle_path(sha))
        scale = first_guess_scale(shipped.nets, [samples(s["prompt"], s["output"])
                                                 for s in data])
        CopyModel(shipped.nets, dict(shipped.meta, first_scale=scale)).save(bundle_path(sha))
        print(f"{bundle_path(sha).name}: first_scale {scale:.3f} ({len(data)} dev streams)")
        return 0
    meta = {"target": llm.model.path.name, "target_sha256": sha,
            "data": f"{len(data)} dev streams (scripts/fit_copy_model.py, --edit-step "
                    f"{ns.edit_step})"}
    log("held-out report (this machine's costs and GPU-like ones)")
    held_out = held_out_report(data, table, meta, more_costs={"gpu_like": gpu},
                               is_eog=eog.__contains__)
    report = {"command": "python scripts/fit_copy_model.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "machine": describe(where),
              "features": list(FEATURES),
              "this_machine": held_out,
              "gpu_like": held_out.pop("simulated_more")["gpu_like"]}
    model = fit(data, meta=meta)
    model.save(bundle_path(sha))
    report["bundle"] = bundle_path(sha).name
    report["n_samples"] = model.meta["n_samples"]
    report["copy_break"] = model.copy_break   # what the long-copy rule expects a copy to do
    Path(ns.report).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

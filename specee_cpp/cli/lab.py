"""Research and maintenance commands: calibrate, quantize, profile, fit-controller, costs,
bench. They are listed apart in `--help` (their own panel)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..bench.prompts import DEV_PROMPTS
from ..config import FIXED_GAMMAS, N_CTX, N_CTX_COSTS, LoadConfig
from ..errors import SpeceeError
from .common import (OptCtx, OptDraft, OptGpu, OptThreads, _default_pair, _load_config, app, err,
                     out)

# listed apart in --help: what a researcher or maintainer runs, not a user every day
LAB = "Research and maintenance"


@app.command(rich_help_panel=LAB)
def calibrate(
    model: str = typer.Argument(..., help="Target: registry name or .gguf path."),
    prompts: Path = typer.Option(DEV_PROMPTS, "--prompts",
                                 help="Spec-Bench style JSONL (default: the shipped dev half)."),
    draft: Optional[str] = OptDraft,
    provider: str = typer.Option("draft", "--provider", help="Candidates: draft or ngram."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Bundle to write (.npz)."),
    n_prompts: int = typer.Option(0, "--n-prompts",
                                  help="Use N prompts spread evenly over the file (0: all)."),
    n_tokens: int = typer.Option(48, "--n-tokens", help="Continuation tokens per prompt."),
    min_layer: int = typer.Option(0, "--min-layer", help="First calibrated layer (0: half)."),
    threshold: float = typer.Option(0.5, "--threshold",
                                    help="Exit threshold stored in the bundle."),
    n_ctx: int = OptCtx, threads: int = OptThreads,
) -> None:
    """Fit the early-exit predictors and the offline schedule on dev prompts, and
    choose on held-out ones, per quality target, the thresholds whose exits stay within it."""
    from ..bench.prompts import fitting_pool, load_spec_bench
    from ..early_exit.calibrate import CalibConfig, calibrate as run_calibration
    from ..early_exit.mode import bundle_path, candidates
    from ..engine.llm import LLM

    texts = [p.text for p in fitting_pool(load_spec_bench(prompts), n_prompts)]
    cfg = CalibConfig(n_tokens=n_tokens, min_layer=min_layer, threshold=threshold)
    with LLM(model, draft=draft, config=_load_config(n_ctx, threads, 0)) as llm:
        cands = candidates(llm, provider, cfg.k)
        out = out or bundle_path(llm.model.sha256, provider)
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"),
                      TimeRemainingColumn(), console=err) as bar:
            task = bar.add_task("calibrating", total=len(texts))

            def progress(desc: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=desc)

            report = run_calibration(llm, cands, texts, out, cfg, progress=progress)
    table = Table(title=f"exit predictors ({provider}), validation split")
    for col in ("layer", "precision", "recall", "label rate", "exit rate"):
        table.add_column(col)
    rates = report.get("exit_rate", {})
    for layer, r in report["per_layer"].items():
        table.add_row(str(layer), f"{r['precision']:.2f}", f"{r['recall']:.2f}",
                      f"{r['positive_rate']:.2f}", f"{rates.get(layer, 0):.3f}")
    err.print(table)
    from ..provenance import describe

    err.print(f"measured on: {describe(report['machine'])}")
    err.print(f"offline schedule {report['offline']}; exit ratio {report['exit_ratio']:.2f}, "
              f"agreement {report['exit_agreement']}, mean exit layer {report['mean_exit_layer']}")
    _print_plans(report["exit_plans"])
    err.print(f"[green]wrote[/green] {out}", soft_wrap=True)


def _print_plans(plans: dict) -> None:
    """Per rule and quality target: the layers allowed to exit, at what threshold, and how
    their exits fared together on the held-out prompts."""
    from ..early_exit.quality import upper_bound

    for rule, by_target in plans.items():
        ct = Table(title=f"{rule} rule: exits within each --max-exit-error on the held-out "
                         f"prompts (95% bound)")
        for col in ("target", "layers (threshold)", "exit ratio", "wrong", "bound"):
            ct.add_column(col)
        for t, p in by_target.items():
            layers = " ".join(f"{l}({th:g})" for l, th in p["thresholds"].items()) or "none"
            ct.add_row(t, layers, f"{p['exits'] / max(p['tokens'], 1):.2f}",
                       f"{p['wrong']}/{p['exits']}", f"{upper_bound(p['wrong'], p['exits']):.2%}"
                       if p["exits"] else "-")
        err.print(ct)


@app.command(rich_help_panel=LAB)
def quantize(
    src: str = typer.Argument(..., help="Model to quantize: registry name or .gguf path."),
    types: str = typer.Option("Q8_0,Q4_K_M,IQ4_NL,Q3_K_M,Q2_K", "--types",
                              help="Comma-separated llama.cpp types."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Default: the model cache."),
    threads: int = OptThreads,
) -> None:
    """Make quantized variants of a model with llama.cpp's quantizer (the compression ladder)."""
    from ..bindings.quantize import parse_types, quantize as run_quantize
    from ..models.registry import resolve_model
    from ..paths import models_dir

    path = resolve_model(src)
    names = parse_types(types)
    for i, qtype in enumerate(names, 1):
        with err.status(f"[{i}/{len(names)}] quantizing {path.name} to {qtype}"):
            out, warning = run_quantize(path, qtype, out_dir or models_dir(), threads)
        if warning:
            err.print(f"[yellow]note:[/yellow] {warning}", soft_wrap=True)
        err.print(f"[green]ok[/green] {qtype}: {out} ({out.stat().st_size / 2**20:.0f} MiB)",
                  soft_wrap=True)


@app.command(rich_help_panel=LAB)
def profile(
    model: str = typer.Argument(..., help="Target: registry name or .gguf path."),
    draft: str = typer.Option(..., "--draft", "-d", help="Draft model."),
    prompts: Path = typer.Option(DEV_PROMPTS, "--prompts",
                                 help="Spec-Bench style JSONL (default: the shipped dev half)."),
    out: Path = typer.Option(..., "--out", "-o", help="JSONL to append the records to."),
    gammas: str = typer.Option(",".join(map(str, FIXED_GAMMAS)), "--gammas",
                               help="Draft lengths to profile."),
    n_prompts: int = typer.Option(64, "--n-prompts",
                                  help="Fitting pool: this many prompts spread over the file "
                                       "(the ones calibrate uses; bench excludes them)."),
    per_category: int = typer.Option(2, "--per-category",
                                     help="Prompts of each category taken from the pool (0: all)."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="Tokens per generation."),
    threads: int = OptThreads,
) -> None:
    """Record step-level speculative decoding data (draft confidence, acceptance, times)."""
    from ..engine.llm import LLM
    from ..speculative.profile import profile as run_profile

    try:
        gamma_list = [int(g) for g in gammas.split(",")]
    except ValueError:
        raise SpeceeError(f"--gammas must be comma-separated integers, got {gammas!r}") from None
    if not gamma_list or min(gamma_list) < 1:
        raise SpeceeError(f"--gammas must be positive, got {gammas!r}")
    from ..bench.prompts import fitting_pool, load_spec_bench, per_category as by_category

    pool = fitting_pool(load_spec_bench(prompts), n_prompts)
    pairs = [(p.category, p.text) for p in by_category(pool, per_category)]
    with LLM(model, draft=draft, config=_load_config(N_CTX, threads, 0)) as llm:
        with Progress(TextColumn("profiling"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"),
                      TimeRemainingColumn(), console=err) as bar:
            task = bar.add_task("profile", total=len(pairs) * len(gamma_list))
            n = run_profile(llm, pairs, gamma_list, max_tokens, out,
                            progress=lambda done, total: bar.update(task, completed=done))
    from ..provenance import describe, machine

    err.print(f"[green]wrote[/green] {n} round records to {out} (measured on "
              f"{describe(machine(LoadConfig(n_threads=threads).threads))})", soft_wrap=True)


@app.command("fit-controller", rich_help_panel=LAB)
def fit_controller(
    profiles: list[Path] = typer.Argument(..., help="JSONL files written by specee-cpp profile."),
    draft: str = typer.Option(..., "--draft", "-d", help="The draft the profiles used."),
    target: str = typer.Option(..., "--target", help="One of the profiled targets (its shape "
                               "is recorded: the controller serves any quantization of it)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o",
                                            help="Default: the shipped file for this draft."),
) -> None:
    """Fit the draft-length controller (acceptance MLPs) on profile records of dev prompts;
    reports its error on every fifth prompt, held out from a first fit."""
    from ..models.gguf_info import read_gguf_info
    from ..models.pull import file_sha256
    from ..models.registry import resolve_model
    from ..records import records as read_records
    from ..speculative.acceptance import fit, held_out_report
    from ..speculative.mode import controller_path

    records = [r for f in profiles for r in read_records(f, what="profile file")]
    # the controller is keyed by the draft's bytes and checked against the target's shape:
    # both come from the files, no model is loaded
    draft_path, target_info = resolve_model(draft), read_gguf_info(resolve_model(target))
    draft_sha = file_sha256(draft_path)
    meta = {"draft_sha256": draft_sha, "draft": draft_path.name,
            "target_shape": [target_info.arch, target_info.n_layer, target_info.n_embd],
            "profiles": [f.name for f in profiles]}
    path = out_path or controller_path(draft_sha)
    with err.status("fitting without the held-out prompts"):
        rep = held_out_report(records, meta=meta)
    if "rate_mae" in rep:
        err.print(f"held-out prompts {rep['held_out_prompts']}: acceptance-rate MAE "
                  f"{rep['rate_mae']:.3f} (constant baseline {rep['rate_mae_constant']:.3f})")
    if "token_accuracy" in rep:
        err.print(f"per-token acceptance: accuracy {rep['token_accuracy']:.3f} "
                  f"(base rate {rep['token_base_rate']:.3f})")
    with err.status(f"fitting on all {len(records)} rounds"):
        model = fit(records, meta=dict(meta, held_out_mae=rep.get("rate_mae")))
    model.save(path)
    err.print(f"[green]wrote[/green] {path}", soft_wrap=True)


@app.command(rich_help_panel=LAB)
def costs(
    model: Optional[str] = typer.Argument(
        None, help="Target: registry name or .gguf path (default: the default pair)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d",
                                        help="Draft model (default: the default pair's)."),
    threads: int = OptThreads,
    gpu_like: bool = typer.Option(False, "--gpu-like",
                                  help="Also show a GPU-like machine (flat verify, draft 0.1)."),
) -> None:
    """Measure (once, then cached) the speculative cost table of a pair, at a short and a
    long context, and show which draft length it would choose at each acceptance rate
    (the policies read it at the current context length, interpolated)."""
    from ..engine.llm import LLM
    from ..speculative.mode import choose_variant, cost_model_shown
    from ..speculative.simulate import gpu_like as gpu_shape

    model, draft = _default_pair(model, draft)
    if draft is None:
        raise SpeceeError("costs compares a draft with its target: pass --draft")

    with LLM(model, draft=draft, config=_load_config(N_CTX_COSTS, threads, 0)) as llm:
        chosen = choose_variant(llm, err.status) if llm.draft_auto else ""
        cm = cost_model_shown(llm, err.status, "measuring target batches 1..16 and draft "
                              "tokens (once, then cached)")
        bpw = llm.model.bits_per_weight
        prompts = llm.prompt_kernels
    if chosen:
        err.print(f"NAME:auto chose: {chosen}")
    from ..provenance import describe

    err.print(f"measured on: {describe(cm.machine)}")
    for name, how in prompts.items():
        err.print(f"prompt batches, {name}: {how}")
    if cm.draft_attention:
        from ..engine.draft_attention import describe as attention

        err.print(f"draft attention: {attention(cm.draft_flash_attn, cm.draft_attention)}")
    machines = [(f"this machine, {p.context}-token context", p) for p in cm.points]
    if gpu_like:
        machines.append(("GPU-like", gpu_shape(cm.points[0], bpw)))
    for name, m in machines:
        v1 = m.plain
        err.print(f"[bold]{name}[/bold]: plain token {1e3 * v1:.1f} ms; draft token "
                  f"{m.draft_token_s / v1:.2f} of a target token; verify n=2,4,8,16: "
                  + ", ".join(f"{m.verify(n) / v1:.2f}" for n in (2, 4, 8, 16))
                  + ("; free drafts from the context, verify n="
                     + ",".join(map(str, m.long_sizes)) + ": "
                     + ", ".join(f"{x / v1:.2f}" for x in m.long_batch_s)
                     if m.long_sizes else ""))
        table = Table(title=f"{name}: best draft length by acceptance")
        for col in ("acceptance", "best gamma", "expected speed vs plain",
                    "pays with a draft token up to"):
            table.add_column(col)
        for a in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
            g = m.best_gamma(a)
            c = m.paying_draft_cost(a)
            table.add_row(f"{a:.2f}", str(g), f"{m.expected_tps(a, g) * v1:.2f}",
                          f"{c:.2f}" if c > 0 else "none (verification alone loses)")
        out.print(table)
        err.print(_pays_from(m))


def _pays_from(m) -> str:
    """One line: from which acceptance this table's draft pays, or why none does."""
    a = m.paying_acceptance()
    share = m.draft_token_s / m.plain
    if a is not None:
        return f"this draft ({share:.2f} of a target token) pays from acceptance {a:.2f}"
    return (f"this draft ({share:.2f} of a target token) pays at no acceptance: with every "
            f"drafted token accepted, no draft length beats plain decoding here")


# ---- bench ----------------------------------------------------------------------------------


@app.command(rich_help_panel=LAB)
def bench(
    model: Optional[str] = typer.Argument(None, help="Target: registry name or .gguf path."),
    draft: Optional[str] = OptDraft,
    prompts: str = typer.Option(str(DEV_PROMPTS), "--prompts",
                                help="Spec-Bench style JSONL file, humaneval:LO-HI (completions), "
                                     "humaneval-edit:LO-HI (code edits, chat; the original code is "
                                     "their prediction), humaneval-refactor:LO-HI (refactoring "
                                     "requests, likewise) or prose-edit:N (edits of N dev "
                                     "articles; the article is the prediction)."),
    configs: str = typer.Option("quick", "--configs",
                                help="Comma-separated configurations or groups (quick, peers, "
                                     "all)."),
    per_category: int = typer.Option(3, "--per-category", help="Prompts per category (0: all)."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="New tokens per prompt."),
    max_prompt_tokens: int = typer.Option(0, "--max-prompt-tokens",
                                          help="Cut longer user messages in the middle "
                                               "(0: never)."),
    turns: int = typer.Option(1, "--turns",
                              help="Multi-turn records: also measure turns 2..N, each in its "
                                   "conversation (earlier turns answered by the model), "
                                   "reported as '<category> turn N'."),
    categories: str = typer.Option("", "--categories",
                                   help="Only these categories, comma-separated (e.g. mt_bench)."),
    exclude_calibration: int = typer.Option(
        64, "--exclude-calibration",
        help="Skip the prompts `calibrate --n-prompts N` fits on (0: keep all)."),
    out_prefix: str = typer.Option("bench/run", "--out",
                                   help="Output prefix: .jsonl (raw), .json, .md, .png."),
    title: str = typer.Option("", "--title", help="Title of the chart and the report."),
    fresh: bool = typer.Option(False, "--fresh", help="Discard earlier records under --out."),
    repeats: int = typer.Option(1, "--repeats",
                                help="Measure every (prompt, configuration) this many times, "
                                     "each repeat a pass over all prompts (steadier ratios "
                                     "on a noisy machine)."),
    list_configs: bool = typer.Option(False, "--list", help="List the configurations and exit."),
    threads: int = OptThreads, gpu_layers: int = OptGpu, n_ctx: int = OptCtx,
) -> None:
    """Our modes against llama.cpp's speculative tools and llama-cpp-python's prompt lookup:
    speed-up vs plain per category, acceptance, exits, agreement with plain, HumanEval
    pass@1. Interleaved prompt by prompt; an interrupted run resumes."""
    from ..bench import configs as cfgs
    from ..bench.suite import BenchOptions, run

    if list_configs:
        for c in cfgs.CONFIGS.values():
            out.print(f"{c.name:20s} {'lossless' if c.lossless else 'lossy   '} {c.describe}")
        return
    if model is None:
        raise SpeceeError("name the target model (registry name or .gguf path)")
    opts = BenchOptions(model=model, draft=draft, prompts=prompts, configs=configs,
                        per_category=per_category, max_tokens=max_tokens,
                        max_prompt_tokens=max_prompt_tokens, turns=turns, categories=categories,
                        exclude_calibration=exclude_calibration, out=out_prefix,
                        threads=threads, gpu_layers=gpu_layers, n_ctx=n_ctx, fresh=fresh,
                        repeats=repeats)
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeRemainingColumn(),
                  console=err) as bar:
        task = bar.add_task("bench", total=None)

        def progress(done: int, total: int, desc: str) -> None:
            bar.update(task, completed=done, total=total, description=desc)

        summary = run(opts, progress, title=title)
    table = Table(title=f"specee-cpp bench: {summary['prompts']} prompts")
    for col in ("configuration", "tok/s", "speed-up", "end to end", "acceptance",
                "identical to plain"):
        table.add_column(col)
    for name, e in summary["configs"].items():
        acc = e.get("acceptance")
        table.add_row(name, f"{e['tps']:.1f}", f"{e['speedup']:.3f}" if e["speedup"] else "-",
                      f"{e['e2e_speedup']:.3f}" if e["e2e_speedup"] else "-",
                      f"{acc:.2f}" if acc is not None else "-",
                      f"{e['identical']:.2f}" if e["identical"] is not None else "-")
    out.print(table)
    err.print(f"wrote {out_prefix}.json, .md, .png (raw records: {out_prefix}.jsonl)",
              soft_wrap=True)



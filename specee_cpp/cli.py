"""`specee-cpp` command line: thin typer adapters over the API; all rich rendering lives here.

User mistakes (SpeceeError) print one line on stderr and exit 1, never a traceback.
"""
from __future__ import annotations

import functools
import inspect
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from .bench.prompts import DEV_PROMPTS
from .config import FIXED_GAMMAS, N_CTX, N_CTX_COSTS, LoadConfig, SamplingConfig
from .errors import SpeceeError
from .models.registry import load_registry

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Fast local LLM decoding on a patched llama.cpp.")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

_EXIT_WORDS = {"/exit", "/quit", "/bye"}


@app.callback()
def _global(no_amx: bool = typer.Option(
        False, "--no-amx", help="Keep weights out of llama.cpp's AMX buffer (Intel AMX CPUs); "
                                "same as GGML_CPU_NO_AMX=1.")) -> None:
    if no_amx:
        # read by patched ggml-cpu when its buffer types are first listed (at model load)
        import os

        from .provenance import NO_AMX_ENV

        os.environ[NO_AMX_ENV] = "1"


# ---- shared options -------------------------------------------------------------------------

def _load_config(n_ctx: int, threads: int, gpu_layers: int) -> LoadConfig:
    if gpu_layers:
        from .bindings._ffi import ll

        if not ll.llama_supports_gpu_offload():
            err.print(f"[yellow]warning:[/yellow] --gpu-layers {gpu_layers} ignored: this build "
                      f"has no GPU backend (rebuild with CMAKE_ARGS=-DGGML_CUDA=on)")
    return LoadConfig(n_ctx=n_ctx, n_threads=threads, n_gpu_layers=gpu_layers)


def _default_pair(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """No model named: the registry's default pair (a draft given still wins)."""
    if model is not None:
        return model, draft
    reg = load_registry()
    target, _ = reg.pair("default")
    return target.name, draft or reg.draft_ref("default")


def _load(model: str, draft: str | None, config: LoadConfig):
    """Load with a status line (a 1.5B model takes seconds)."""
    from .engine.llm import LLM

    with err.status(f"loading {model}" + (f" + draft {draft}" if draft else "")):
        return LLM(model, draft=draft, config=config)


def _sampling(temperature: float, top_k: int, top_p: float, seed: int) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


OptDraft = typer.Option(None, "--draft", "-d", help=(
    "Draft model: registry name or .gguf path; NAME:TYPE requantized, NAME:vN with its head cut "
    "to the N most frequent tokens, NAME:auto the variant this machine's costs favour."))
OptMaxTokens = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate.")
OptTemp = typer.Option(0.0, "--temperature", "-t", help="0 is greedy (deterministic).")
OptTopK = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0: all).")
OptTopP = typer.Option(1.0, "--top-p", help="Nucleus sampling mass.")
OptSeed = typer.Option(0, "--seed", help="Random seed for sampling.")
OptCtx = typer.Option(N_CTX, "--n-ctx", help="Context window in tokens.")
OptThreads = typer.Option(0, "--threads", help="CPU threads (0: automatic).")
OptGpu = typer.Option(0, "--gpu-layers", help="Layers to offload to the GPU (-1: all).")
OptMode = typer.Option(None, "--mode",
                       help="Decoding mode: plain, spec (draft then verify), ee (early exit) "
                            "or spec-ee (draft then verify, the verify batch exiting early); "
                            "default: spec with the cost-aware --gamma auto when a draft is "
                            "given (plain decoding wherever drafting cannot pay), else plain.")
OptGamma = typer.Option(None, "--gamma",
                        help="spec: auto (default; cost-aware controller, drafts only where it "
                             "pays), a fixed number of tokens per round, or stop, pmin, hf, "
                             "speckv.")
OptContext = typer.Option(None, "--context/--no-context",
                          help="spec, gamma auto/stop: also draft for free from the context "
                               "where that pays (default: on).")
OptHistory = typer.Option(None, "--history/--no-history",
                          help="spec, gamma auto/stop: also draft from your earlier outputs, "
                               "kept on this machine only ($SPECEE_CPP_HOME/history, bounded, "
                               "safe to delete). Default: off.")
OptController = typer.Option(None, "--controller",
                             help="spec: fitted draft-length controller (default: shipped).")
OptProvider = typer.Option(None, "--provider",
                           help="ee candidates: draft (default with a draft model) or ngram "
                                "(default without).")
OptPredictors = typer.Option(None, "--predictors", help="ee predictor bundle (default: shipped).")
OptThreshold = typer.Option(None, "--threshold", help="ee exit threshold (default: bundle's).")
OptMaxErr = typer.Option(None, "--max-exit-error",
                         help="ee quality target: per layer, the loosest threshold whose exits "
                              "emitted another token than full depth at most this often on "
                              "held-out calibration prompts (default 0.01).")
OptUnsafe = typer.Option(None, "--unsafe-exits",
                         help="ee, spec-ee: allow exits whose error was not measured against "
                              "the quality target (a --threshold below 1, a bundle without "
                              "exit curves).")
OptRule = typer.Option(None, "--exit-rule",
                       help="ee rule: argmax (SpecEE, default) or candidate.")

# The decoding-mode flags, declared once for generate, chat and serve (``with_mode_flags``):
# parameter -> (the mode option it sets, None for --mode itself; its type; its typer option).
# The options themselves are the modes' dataclasses (engine/modes.py).
_MODE_PARAMS = {
    "mode": (None, Optional[str], OptMode),
    "gamma": ("gamma", Optional[str], OptGamma),
    "controller": ("controller", Optional[str], OptController),
    "context": ("context", Optional[bool], OptContext),
    "history": ("history", Optional[bool], OptHistory),
    "provider": ("provider", Optional[str], OptProvider),
    "predictors": ("predictors", Optional[str], OptPredictors),
    "threshold": ("threshold", Optional[float], OptThreshold),
    "exit_rule": ("rule", Optional[str], OptRule),
    "max_exit_error": ("max_exit_error", Optional[float], OptMaxErr),
    "unsafe_exits": ("unsafe", Optional[bool], OptUnsafe),
}
# mode option -> its flag as typed ("--context/--no-context" -> "--context")
_MODE_FLAGS = {key: opt.param_decls[0].split("/")[0]
               for key, _, opt in _MODE_PARAMS.values() if key}


@dataclass(frozen=True)
class ModeFlags:
    """The decoding-mode flags of one command line: ``--mode`` and the options given."""
    mode: str | None
    given: dict

    def resolve(self, draft: str | None):
        """The registered mode (default: spec with a draft, else plain) and its typed
        options; a flag that belongs to another mode is refused (a silent no-op misleads)."""
        from .engine import modes
        from .spec.mode import parse_gamma

        mode = self.mode or ("spec" if draft else "plain")
        m = modes.get(mode)
        given = {k: v for k, v in self.given.items() if v is not None}
        for key, value in given.items():
            if key not in {f.name for f in fields(m.Options)}:
                owner = next((n for n in modes.names()
                              if key in {f.name for f in fields(modes.get(n).Options)}), "?")
                flag = _MODE_FLAGS[key]
                # a switch is named as typed (--context / --no-context), other flags with value
                given_as = (flag if value else "--no-" + flag[2:]) if isinstance(value, bool) \
                    else f"{flag} {value}"
                raise SpeceeError(f"{given_as} applies to --mode {owner}, not --mode {mode}")
        if "gamma" in given:
            given["gamma"] = parse_gamma(given["gamma"])
        return m, m.options(**given)


def with_mode_flags(command):
    """Give a command the decoding-mode flags of ``_MODE_PARAMS`` after its own; it
    receives them as one ``flags: ModeFlags`` argument. Typer reads the signature set here."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=typ)
             for name, (_, typ, opt) in _MODE_PARAMS.items()]

    @functools.wraps(command)
    def run(*args, **kwargs):
        mode = kwargs.pop("mode")
        given = {key: kwargs.pop(name) for name, (key, _, _) in _MODE_PARAMS.items() if key}
        return command(*args, flags=ModeFlags(mode, given), **kwargs)

    run.__signature__ = sig.replace(parameters=own + added)
    run.__annotations__ = {p.name: p.annotation for p in own + added}
    return run


def _sources(by_source: dict[str, list[int]]) -> str:
    """Who drafted: ", all from the model", or accepted/drafted per source where several
    did ("; context 60/70, model 9/20")."""
    if len(by_source) == 1:
        return f", all from the {next(iter(by_source))}"
    return "; " + ", ".join(f"{k} {a}/{d}" for k, (d, a) in sorted(by_source.items()))


def _stats_line(stats, verbose: bool = False) -> str:
    """One line after an answer: tokens, speed and, where drafted, the share kept (or the
    share of tokens that exited early); ``verbose`` adds the prefill, who drafted, the mean
    exit layer and the mode's note (what it chose for this machine and why)."""
    parts = [f"{stats.n_gen} tokens", f"{stats.decode_tps:.1f} tok/s"]
    if verbose:
        parts.append(f"prefill {stats.n_prompt} tok in {stats.prefill_s:.2f} s")
    if stats.n_drafted:
        parts.append(f"drafted {stats.n_drafted}, accepted {stats.n_accept} "
                     f"({stats.acceptance:.0%}{_sources(stats.by_source)})" if verbose
                     else f"{stats.acceptance:.0%} of {stats.n_drafted} drafted kept")
    n_exit = sum(stats.exit_layers.values())
    if n_exit:
        mean = sum(k * v for k, v in stats.exit_layers.items()) / n_exit
        share = f"exits {n_exit / max(stats.n_gen, 1):.0%}"
        parts.append(f"{share} at mean layer {mean:.1f}" if verbose else f"{share} early")
    line = ", ".join(parts)
    return f"{line}; {stats.note}" if verbose and stats.note else line


OptVerbose = typer.Option(False, "--verbose", "-v",
                          help="After each answer, also what was chosen for this machine and "
                               "why (prefill, drafts by source, exits, the mode's note).")


# ---- generate / chat ------------------------------------------------------------------------

@app.command()
@with_mode_flags
def generate(
    model: str = typer.Argument(..., help="Registry name or path to a .gguf file."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt."),
    draft: Optional[str] = OptDraft,
    max_tokens: int = OptMaxTokens,
    temperature: float = OptTemp, top_k: int = OptTopK, top_p: float = OptTopP,
    seed: int = OptSeed,
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    verbose: bool = OptVerbose,
    n_ctx: int = OptCtx, threads: int = OptThreads, gpu_layers: int = OptGpu,
    flags: ModeFlags = None,
) -> None:
    """Generate a reply to one prompt, streamed to stdout (statistics on stderr)."""
    from .engine.llm import LLM

    from .engine.steps import Transcript

    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    with LLM(model, draft=draft, config=_load_config(n_ctx, threads, gpu_layers)) as llm:
        m.prepare(llm, opts, status=err.status)
        done = Transcript()
        for step in llm.stream(prompt, max_tokens=max_tokens, sampling=sampling, chat=not raw,
                               mode=m, options=opts):
            done.add(step)
            if not as_json:
                out.print(step.text, end="", markup=False, soft_wrap=True)
        if as_json:
            print(json.dumps({"model": str(llm.model.path), "mode": m.name, "text": done.text,
                              "tokens": done.tokens, "stats": done.stats.as_dict()}))
        else:
            out.print()
            err.print(f"[dim]{escape(_stats_line(done.stats, verbose))}[/dim]")


@app.command()
@with_mode_flags
def chat(
    model: Optional[str] = typer.Argument(
        None, help="Registry name or .gguf path (default: the registry's default pair)."),
    draft: Optional[str] = OptDraft,
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt."),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Most tokens per reply."),
    temperature: float = OptTemp, top_k: int = OptTopK, top_p: float = OptTopP,
    seed: int = OptSeed,
    verbose: bool = OptVerbose,
    n_ctx: int = OptCtx, threads: int = OptThreads, gpu_layers: int = OptGpu,
    flags: ModeFlags = None,
) -> None:
    """Multi-turn chat in the terminal. /exit ends it; Ctrl-C stops the current reply."""
    from .engine.steps import Transcript

    model, draft = _default_pair(model, draft)
    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    llm = _load(model, draft, _load_config(n_ctx, threads, gpu_layers))
    with llm:
        m.prepare(llm, opts, status=err.status)
        err.print(f"[bold]{llm.model.path.name}[/bold]"
                  + (f" + draft {llm.draft_path.name}" if llm.draft_path else "")
                  + f", mode {m.name}. Type /exit to quit, Ctrl-C stops a reply.")
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        while True:
            try:
                user = input("\n> ")
            except EOFError:
                break
            except KeyboardInterrupt:
                err.print("\n[dim](Ctrl-C at the prompt: type /exit or press Ctrl-D to quit)[/dim]")
                continue
            if user.strip() in _EXIT_WORDS:
                break
            if not user.strip():
                continue
            messages.append({"role": "user", "content": user})
            reply = Transcript()
            try:
                for step in llm.stream(messages, max_tokens=max_tokens, sampling=sampling,
                                       mode=m, options=opts):
                    out.print(reply.add(step).text, end="", markup=False, soft_wrap=True)
            except KeyboardInterrupt:
                err.print("\n[dim](reply stopped)[/dim]", end="")
            except SpeceeError as e:  # e.g. the conversation outgrew the context: keep the session
                err.print(f"\n[red]error:[/red] {e}", markup=True)
                messages.pop()
                continue
            out.print()
            messages.append({"role": "assistant", "content": reply.text})
            if reply.stats is not None:
                err.print(f"[dim]{escape(_stats_line(reply.stats, verbose))}[/dim]")


@app.command()
@with_mode_flags
def serve(
    model: Optional[str] = typer.Argument(
        None, help="Registry name or .gguf path (default: the registry's default pair)."),
    draft: Optional[str] = OptDraft,
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to listen on (default: this machine only)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: any free port)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="SPECEE_CPP_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every route."),
    max_queue: int = typer.Option(16, "--max-queue",
                                  help="Requests that may wait; past it the answer is 429."),
    temperature: float = OptTemp, top_k: int = OptTopK, top_p: float = OptTopP,
    seed: int = OptSeed,
    n_ctx: int = OptCtx, threads: int = OptThreads, gpu_layers: int = OptGpu,
    flags: ModeFlags = None,
) -> None:
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models,
    /health). Sampling flags and the mode are defaults that a request may override."""
    import socket

    try:
        import uvicorn

        from .server.app import ServeConfig, create_app
    except ImportError as e:
        raise SpeceeError(f"specee-cpp serve needs the server extra ({e.name} is missing): "
                          f"pip install 'specee-cpp[server]'") from None

    model, draft = _default_pair(model, draft)
    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    # bound before loading, so a taken port is one line now, not after a minute of loading
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise SpeceeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    llm = _load(model, draft, _load_config(n_ctx, threads, gpu_layers))
    with llm:
        m.prepare(llm, opts, status=err.status)
        cfg = ServeConfig(model_name=Path(model).stem if model.endswith(".gguf") else model,
                          mode=m, options=opts, sampling=sampling, api_key=api_key,
                          max_queue=max_queue)
        server = uvicorn.Server(uvicorn.Config(create_app(llm, cfg), log_level="warning",
                                               timeout_graceful_shutdown=5))
        bound = sock.getsockname()
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            err.print(f"[yellow]warning:[/yellow] listening on {host} without --api-key: "
                      f"anyone who can reach this machine can use the model")
        # one line on stdout with the address (scripts and tests read it; port 0 picks one)
        print(f"specee-cpp serving {cfg.model_name} (mode {m.name}) on "
              f"http://{bound[0]}:{bound[1]}/v1", flush=True)
        server.run(sockets=[sock])


@app.command()
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
    curves_only: bool = typer.Option(
        False, "--curves-only",
        help="Keep the bundle's predictors; measure only its exit curves (the quality target's "
             "data) on its validation prompts."),
    n_ctx: int = OptCtx, threads: int = OptThreads,
) -> None:
    """Fit the early-exit predictors and the offline schedule on dev prompts, and measure
    each layer's exit curve (exit rate and error by threshold) on held-out ones."""
    from .bench.prompts import fitting_pool, load_spec_bench
    from .ee.calibrate import CalibConfig, add_curves, calibrate as run_calibration
    from .ee.mode import bundle_path, candidates
    from .engine.llm import LLM

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

            run = add_curves if curves_only else run_calibration
            report = run(llm, cands, texts, out, cfg, progress=progress)
    if curves_only:
        _print_curves(report["exit_curves"])
        err.print(f"[green]wrote[/green] exit curves into {out}", soft_wrap=True)
        return
    table = Table(title=f"exit predictors ({provider}), validation split")
    for col in ("layer", "precision", "recall", "label rate", "exit rate"):
        table.add_column(col)
    rates = report.get("exit_rate", {})
    for layer, r in report["per_layer"].items():
        table.add_row(str(layer), f"{r['precision']:.2f}", f"{r['recall']:.2f}",
                      f"{r['positive_rate']:.2f}", f"{rates.get(layer, 0):.3f}")
    err.print(table)
    _print_curves(report["exit_curves"])
    from .provenance import describe

    err.print(f"measured on: {describe(report['machine'])}")
    err.print(f"offline schedule {report['offline']}; exit ratio {report['exit_ratio']:.2f}, "
              f"agreement {report['exit_agreement']}, mean exit layer {report['mean_exit_layer']}")
    err.print(f"[green]wrote[/green] {out}", soft_wrap=True)


def _print_curves(curves: dict) -> None:
    """Per rule, each layer's exit rate and the error of those exits at every threshold."""
    for rule in ("argmax", "candidate"):
        ct = Table(title=f"{rule} rule, validation prompts ({curves['n_tokens']} tokens): "
                         f"exit rate / error of those exits, by threshold")
        ct.add_column("layer")
        for t in curves["grid"]:
            ct.add_column(str(t))
        for layer, curve in curves[rule].items():
            ct.add_row(layer, *(f"{f / max(curves['n_tokens'], 1):.2f}/{w / f:.2f}" if f else "-"
                                for f, w in curve))
        err.print(ct)


@app.command()
def quantize(
    src: str = typer.Argument(..., help="Model to quantize: registry name or .gguf path."),
    types: str = typer.Option("Q8_0,Q4_K_M,IQ4_NL,Q3_K_M,Q2_K", "--types",
                              help="Comma-separated llama.cpp types."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Default: the model cache."),
    threads: int = OptThreads,
) -> None:
    """Make quantized variants of a model with llama.cpp's quantizer (the compression ladder)."""
    from .bindings.quantize import parse_types, quantize as run_quantize
    from .models.registry import resolve_model
    from .paths import models_dir

    path = resolve_model(src)
    names = parse_types(types)
    for i, qtype in enumerate(names, 1):
        with err.status(f"[{i}/{len(names)}] quantizing {path.name} to {qtype}"):
            out, warning = run_quantize(path, qtype, out_dir or models_dir(), threads)
        if warning:
            err.print(f"[yellow]note:[/yellow] {warning}", soft_wrap=True)
        err.print(f"[green]ok[/green] {qtype}: {out} ({out.stat().st_size / 2**20:.0f} MiB)",
                  soft_wrap=True)


@app.command()
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
    from .engine.llm import LLM
    from .spec.profile import profile as run_profile

    try:
        gamma_list = [int(g) for g in gammas.split(",")]
    except ValueError:
        raise SpeceeError(f"--gammas must be comma-separated integers, got {gammas!r}") from None
    if not gamma_list or min(gamma_list) < 1:
        raise SpeceeError(f"--gammas must be positive, got {gammas!r}")
    from .bench.prompts import fitting_pool, load_spec_bench, per_category as by_category

    pool = fitting_pool(load_spec_bench(prompts), n_prompts)
    pairs = [(p.category, p.text) for p in by_category(pool, per_category)]
    with LLM(model, draft=draft, config=_load_config(N_CTX, threads, 0)) as llm:
        with Progress(TextColumn("profiling"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"),
                      TimeRemainingColumn(), console=err) as bar:
            task = bar.add_task("profile", total=len(pairs) * len(gamma_list))
            n = run_profile(llm, pairs, gamma_list, max_tokens, out,
                            progress=lambda done, total: bar.update(task, completed=done))
    from .provenance import describe, machine

    err.print(f"[green]wrote[/green] {n} round records to {out} (measured on "
              f"{describe(machine(LoadConfig(n_threads=threads).threads))})", soft_wrap=True)


@app.command("fit-controller")
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
    from .models.gguf_info import read_gguf_info
    from .models.pull import file_sha256
    from .models.registry import resolve_model
    from .records import records as read_records
    from .spec.acceptance import fit, held_out_report
    from .spec.mode import controller_path

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


@app.command()
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
    from .engine.llm import LLM
    from .spec.mode import choose_variant, cost_model_shown
    from .spec.simulate import gpu_like as gpu_shape

    model, draft = _default_pair(model, draft)
    if draft is None:
        raise SpeceeError("costs compares a draft with its target: pass --draft")

    with LLM(model, draft=draft, config=_load_config(N_CTX_COSTS, threads, 0)) as llm:
        chosen = choose_variant(llm, err.status) if llm.draft_auto else ""
        cm = cost_model_shown(llm, err.status, "measuring target batches 1..16 and draft "
                              "tokens (once, then cached)")
        bpw = llm.model.bits_per_weight
    if chosen:
        err.print(f"NAME:auto chose: {chosen}")
    from .provenance import describe

    err.print(f"measured on: {describe(cm.machine)}")
    if cm.draft_attention:
        from .engine.attention import describe as attention

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



@app.command()
def bench(
    model: Optional[str] = typer.Argument(None, help="Target: registry name or .gguf path."),
    draft: Optional[str] = OptDraft,
    prompts: str = typer.Option(str(DEV_PROMPTS), "--prompts",
                                help="Spec-Bench style JSONL file, humaneval:LO-HI (completions) "
                                     "or humaneval-edit:LO-HI (code edits, chat)."),
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
    from .bench import configs as cfgs
    from .bench.suite import BenchOptions, run

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


# ---- models ---------------------------------------------------------------------------------

def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=err)


@app.command()
def pull(
    names: Optional[list[str]] = typer.Argument(None, help="Registry names to fetch."),
    pair: Optional[str] = typer.Option(None, "--pair", help="Also fetch this pair's models."),
    force: bool = typer.Option(False, "--force", help="Fetch again even if present."),
    quick: bool = typer.Option(False, "--quick",
                               help="Trust a present file's verification stamp (size, mtime) "
                                    "instead of hashing it again."),
) -> None:
    """Download registry models into the cache, verify their sha256, keep them. A present
    file is hashed again (its bytes may have changed with size and mtime restored)."""
    from .models.pull import is_verified
    from .models.pull import pull as pull_model

    reg = load_registry()
    entries = [reg.get(n) for n in names or []]
    if pair:
        entries += [e for e in reg.pair(pair) if e not in entries]
    if not entries:
        raise SpeceeError(f"name a model or --pair; registry names: "
                          f"{', '.join(sorted(reg.models))}")
    for entry in entries:
        if quick and is_verified(entry):  # nothing to fetch or hash: no progress bar
            err.print(f"[green]ok[/green] {entry.name}: {entry.local_path}", soft_wrap=True)
            continue
        with _progress() as bar:
            task = bar.add_task(entry.name, total=entry.size)

            def progress(desc: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total,
                           description=f"{entry.name} [dim]{desc}[/dim]")

            path = pull_model(entry, progress=progress, force=force, rehash=not quick)
        err.print(f"[green]ok[/green] {entry.name}: {path}", soft_wrap=True)


@app.command()
def models() -> None:
    """List the registry and what is present locally."""
    from .models.pull import is_verified, verified_at

    reg = load_registry()
    table = Table(title="specee-cpp models")
    for col in ("name", "role", "arch", "quant", "size", "local"):
        table.add_column(col)
    for e in reg.models.values():
        if is_verified(e):
            local = f"[green]verified {verified_at(e.local_path) or ''}[/green] {e.local_path}"
        elif e.local_path.is_file():
            local = "[yellow]present, not verified[/yellow]"
        else:
            local = "[dim]-[/dim]"
        table.add_row(e.name, e.role, e.arch, e.quant, f"{e.size / 2**20:.0f} MiB", local)
    out.print(table)
    for name, (t, d) in reg.pairs.items():
        out.print(f"pair [bold]{name}[/bold]: target {t}, draft {d}")


@app.command()
def doctor() -> None:
    """Check the library build, the patch, CPU/GPU features and the cache."""
    from .doctor import diagnose

    rows, ok = diagnose()
    table = Table(title="specee-cpp doctor", show_header=False)
    table.add_column("check")
    table.add_column("result", overflow="fold")
    for k, v in rows:
        table.add_row(k, str(v))
    out.print(table)
    if not ok:
        raise typer.Exit(1)


def _interrupted() -> None:
    cmd = next((a for a in sys.argv[1:] if not a.startswith("-")), "command")
    # every command writes its files whole (temporary name, then rename), so nothing half
    # written is left under a final name
    err.print(f"\ninterrupted: specee-cpp {cmd} stopped by Ctrl-C (exit 130); files it had "
              f"finished are kept, nothing half-written is")


def main() -> None:
    """Entry point: run the app, turning user errors into one line and exit status 1."""
    try:
        # typer turns Ctrl-C into a *returned* 130 outside standalone mode: pass it on, or a
        # script would take an interrupted run for a success
        rc = app(standalone_mode=False)
        if isinstance(rc, int) and rc != 0:
            if rc == 130:
                _interrupted()
            sys.exit(rc)
    except SpeceeError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        _interrupted()
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:  # usage errors in standalone_mode=False
        # click's ClickException, vendored by newer typer releases (no click import then)
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()

"""The command line's shared parts: the app, its consoles, the options every decoding
command takes, the decoding-mode flags and the stats line after an answer."""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..config import N_CTX, LoadConfig, SamplingConfig
from ..errors import SpeceeError
from ..models.registry import load_registry


app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Fast local LLM decoding on a patched llama.cpp.")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@contextmanager
def status_line(text: str):
    """``err.status(text)`` in a terminal; elsewhere (output to a log) the text as a plain
    line first, since no status line shows there: every wait says what it is for."""
    if not err.is_terminal:
        err.print(escape(text), markup=True)
    with err.status(text) as shown:
        yield shown

_EXIT_WORDS = {"/exit", "/quit", "/bye"}


@app.callback()
def _global(no_amx: bool = typer.Option(
        False, "--no-amx", help="Keep weights out of llama.cpp's AMX buffer (Intel AMX CPUs); "
                                "same as SPECEE_CPP_AMX=0.")) -> None:
    if no_amx:
        # the environment carries it to child processes (the crash probe, benchmark runs); this
        # process's library may have read its environment already, so it is told as well
        import os

        from ..bindings import kernel_switch, set_kernel_switch
        from ..provenance import AMX_ENV

        os.environ[AMX_ENV] = "0"
        if kernel_switch("AMX") is not None:
            set_kernel_switch("AMX", 0)


# ---- shared options -------------------------------------------------------------------------

def _load_config(n_ctx: int, threads: int, gpu_layers: int, n_seq: int = 1) -> LoadConfig:
    if gpu_layers:
        from ..bindings._ffi import ll

        if not ll.llama_supports_gpu_offload():
            err.print(f"[yellow]warning:[/yellow] --gpu-layers {gpu_layers} ignored: this build "
                      f"has no GPU backend (rebuild with CMAKE_ARGS=-DGGML_CUDA=on)")
    return LoadConfig(n_ctx=n_ctx, n_threads=threads, n_gpu_layers=gpu_layers, n_seq=n_seq)


def _default_pair(model: str | None, draft: str | None) -> tuple[str, str | None]:
    """No model named: the registry's default pair (a draft given still wins)."""
    if model is not None:
        return model, draft
    reg = load_registry()
    target, _ = reg.pair("default")
    return target.name, draft or reg.draft_ref("default")


def _load(model: str, draft: str | None, config: LoadConfig, measure_now: bool = True):
    """Load with a status line (a 1.5B model takes seconds); ``measure_now``: see LLM."""
    from ..engine.llm import LLM

    with err.status(f"loading {model}" + (f" + draft {draft}" if draft else "")):
        return LLM(model, draft=draft, config=config, measure_now=measure_now)


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
                           help="ee candidates: draft or ngram (default: whichever this "
                                "machine's costs predict fastest; draft only with a draft "
                                "model).")
OptPredictors = typer.Option(None, "--predictors", help="ee predictor bundle (default: shipped).")
OptThreshold = typer.Option(None, "--threshold", help="ee exit threshold (default: bundle's).")
OptMaxErr = typer.Option(None, "--max-exit-error",
                         help="ee, spec-ee: exits choose another token than full depth at "
                              "most this often (95% bound on the calibration's held-out "
                              "prompts; default 0.01). ee checks each exit (a wrong one costs "
                              "time, never output); spec-ee's reach the output.")
OptUnsafe = typer.Option(None, "--unsafe-exits",
                         help="spec-ee: allow exits whose error was not measured against "
                              "the quality target (a --threshold below 1, a bundle without "
                              "exit plans); ee checks every exit, so needs none.")
OptAlways = typer.Option(None, "--probe-always",
                         help="ee: probe for exits even where this machine's costs say they "
                              "cannot pay (to measure them); by default such a run decodes "
                              "plainly and its stats line says why.")
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
    "probe_always": ("always", Optional[bool], OptAlways),
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
        from ..engine import modes
        from ..speculative.mode import parse_gamma

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
    parts = [f"{stats.n_gen} token{'' if stats.n_gen == 1 else 's'}",
             f"{stats.decode_tps:.1f} tok/s"]
    if verbose:
        parts.append(f"prefill {stats.n_prompt - stats.n_cached} tok in "
                     f"{stats.prefill_s:.2f} s"
                     + (f" ({stats.n_cached} cached)" if stats.n_cached else ""))
    if stats.n_drafted:
        parts.append(f"drafted {stats.n_drafted}, accepted {stats.n_accept} "
                     f"({stats.acceptance:.0%}{_sources(stats.by_source)})" if verbose
                     else f"{stats.acceptance:.0%} of {stats.n_drafted} drafted kept")
    if stats.prediction is not None:
        accepted, rejected = stats.prediction
        parts.append(f"prediction {accepted} of {accepted + rejected} tokens in the reply")
    n_exit = sum(stats.exit_layers.values())
    if n_exit:
        mean = sum(k * v for k, v in stats.exit_layers.items()) / n_exit
        share = f"exits {n_exit / max(stats.n_gen, 1):.0%}"
        parts.append(f"{share} at mean layer {mean:.1f}" if verbose else f"{share} early")
    line = ", ".join(parts)
    return f"{line}; {stats.note}" if verbose and stats.note else line


def print_stats(stats, verbose: bool = False) -> None:
    """The stats line after an answer, on stderr (its text is not rich markup)."""
    err.print(f"[dim]{escape(_stats_line(stats, verbose))}[/dim]")


OptVerbose = typer.Option(False, "--verbose", "-v",
                          help="After each answer, also what was chosen for this machine and "
                               "why (prefill, drafts by source, exits, the mode's note).")


# ---- generate / chat ------------------------------------------------------------------------


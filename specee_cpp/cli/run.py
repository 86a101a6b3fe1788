"""The everyday commands: generate, chat, serve."""
from __future__ import annotations

import json
import shlex
import sys
import threading
from contextlib import closing, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..config import MAX_SEQ
from ..errors import SpeceeError
from ..text import checked
from .common import (ModeFlags, OptCtx, OptDraft, OptGpu, OptMaxTokens, OptSeed, OptTemp,
                     OptThreads, OptTopK, OptTopP, OptVerbose, _EXIT_WORDS, _default_pair, _load,
                     _load_config, _sampling, app, err, out, print_stats, status_line,
                     with_mode_flags)


@app.command()
@with_mode_flags
def generate(
    model: str = typer.Argument(..., help="Registry name or path to a .gguf file."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt."),
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", "-f",
        help="Read the prompt from this file (-: standard input), for prompts too long for "
             "a command line."),
    draft: Optional[str] = OptDraft,
    prediction: Optional[Path] = typer.Option(
        None, "--prediction",
        help="A file the reply will mostly repeat (the text being edited): drafted where the "
             "reply follows it and verified, so greedy output is unchanged (modes plain, "
             "spec)."),
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
    from ..engine.llm import LLM

    from ..engine.steps import Transcript
    from ..speculative.mode import idle_costs_job

    prompt = _prompt(prompt, prompt_file)
    predicted = _read_text(prediction, "--prediction") if prediction is not None else None
    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    if predicted is not None and (why := m.refuses_prediction()):
        raise SpeceeError(f"--prediction: {why}")
    with LLM(model, draft=draft, config=_load_config(n_ctx, threads, gpu_layers)) as llm:
        llm.defer_costs = True   # one answer: no idle time to measure in; chat and serve have
        m.prepare(llm, opts, status=status_line)
        # nothing else would ever measure them for a user of generate alone: say how
        unmeasured = draft is not None and idle_costs_job(llm, m, opts) is not None
        done = Transcript()
        for step in llm.stream(prompt, max_tokens=max_tokens, sampling=sampling, chat=not raw,
                               mode=m, options=opts, prediction=predicted):
            done.add(step)
            if not as_json:
                out.print(step.text, end="", markup=False, soft_wrap=True)
        if as_json:
            print(json.dumps({"model": str(llm.model.path), "mode": m.name, "text": done.text,
                              "tokens": done.tokens, "stats": done.stats.as_dict()}))
        else:
            out.print()
            print_stats(done.stats, verbose)
        if unmeasured:
            err.print(f"[dim]({escape(unmeasured_hint(model, draft, threads))})[/dim]")


def unmeasured_hint(model: str, draft: str | None, threads: int) -> str:
    """What a run that drafts without this machine's costs says: how to measure them."""
    command = " ".join(shlex.quote(a) for a in ["specee-cpp", "costs", model, "--draft", draft]
                       + (["--threads", str(threads)] if threads else []))
    return (f"this machine's draft/verify costs are not measured yet, so no draft model "
            f"drafts: `{command}` measures them once (1.5-2 minutes on 2 cores); chat and "
            f"serve measure them while idle")


def _prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from ``-p`` or ``--prompt-file`` (exactly one), as text; bytes that are
    not UTF-8 are refused where the prompt is tokenized, with their position."""
    if (prompt is None) == (prompt_file is None):
        raise SpeceeError("give the prompt with -p TEXT or --prompt-file PATH (one of them)")
    if prompt_file is None:
        return prompt
    return _read_text(prompt_file, "--prompt-file")


def _read_text(path: Path, what: str) -> str:
    """A file's text (``-``: standard input); bytes that are not UTF-8 are refused where the
    text is tokenized, with their position."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
    except OSError as e:
        raise SpeceeError(f"cannot read {what} {path}: {e.strerror or e}") from None
    return data.decode("utf-8", errors="surrogateescape")


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
    """Multi-turn chat in the terminal. /exit ends it; Ctrl-C stops the current reply;
    /predict FILE makes the next reply draft from FILE (the text it will mostly repeat)."""
    if system is not None:
        checked(system, "--system")
    model, draft = _default_pair(model, draft)
    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    # what this machine's timings still lack is taken while the user types (_idle)
    llm = _load(model, draft, _load_config(n_ctx, threads, gpu_layers), measure_now=False)
    with llm:
        llm.defer_costs = True
        m.prepare(llm, opts, status=status_line)
        # stopped before the models are freed (a timing paused mid-way holds a context)
        with closing(_idle(llm, m, opts)) as idle:
            _converse(llm, m, opts, idle, sampling, system, max_tokens, verbose)


def _converse(llm, m, opts, idle, sampling, system: str | None, max_tokens: int,
              verbose: bool) -> None:
    """Chat's turns until /exit or the end of input; ``idle`` (engine/idle.py) measures while
    the user types."""
    from ..engine.steps import Transcript

    err.print(f"[bold]{llm.model.path.name}[/bold]"
              + (f" + draft {llm.draft_path.name}" if llm.draft_path else "")
              + f", mode {m.name}. Type /exit to quit, Ctrl-C stops a reply"
              + (", /predict FILE for an edit of FILE." if m.takes_prediction else "."))
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    predicted: str | None = None   # /predict FILE: for the next reply only
    if hasattr(sys.stdin, "reconfigure"):
        # a line that is not UTF-8 reaches the model's check, which names the byte and
        # keeps the session, instead of ending it in input()
        sys.stdin.reconfigure(errors="surrogateescape")
    answered = False   # the first question never waits on a slice of measurement
    while True:
        try:
            with _while_idle(idle if answered else None):
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
        if user.strip().split()[0] == "/predict":
            predicted = _predict_command(user, m)
            continue
        messages.append({"role": "user", "content": user})
        reply = Transcript()
        try:
            pred, predicted = predicted, None
            for step in llm.stream(messages, max_tokens=max_tokens, sampling=sampling,
                                   mode=m, options=opts, prediction=pred):
                out.print(reply.add(step).text, end="", markup=False, soft_wrap=True)
        except KeyboardInterrupt:
            err.print("\n[dim](reply stopped)[/dim]", end="")
        except SpeceeError as e:  # e.g. the conversation outgrew the context: keep the session
            err.print(f"\n[red]error:[/red] {e}", markup=True)
            messages.pop()
            continue
        out.print()
        answered = True
        messages.append({"role": "assistant", "content": reply.text})
        if reply.stats is not None:
            print_stats(reply.stats, verbose)


def _idle(llm, m, opts):
    """The measurements chat runs while it waits for input (engine/idle.py): the weights'
    read-ahead, then the costs of a speculative run; their lines go to stderr, dim in a
    terminal."""
    from ..engine.idle import idle_work
    from ..speculative.mode import idle_costs_job

    def log(line: str) -> None:
        err.print(f"[dim]({escape(line)})[/dim]")

    return idle_work(llm, idle_costs_job(llm, m, opts, log=log), log)


@contextmanager
def _while_idle(idle):
    """Run ``idle``'s slices on a helper thread for the duration of the block (the user
    typing), then stop them and wait for the one in flight: the models are the reply's
    again."""
    if idle is None or not idle.pending():
        yield
        return
    stop = threading.Event()
    worker = threading.Thread(target=idle.run, args=(stop.is_set,), daemon=True,
                              name="specee-cpp-idle-costs")
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


def _predict_command(line: str, m) -> str | None:
    """``/predict FILE``: the file's text for the next reply (None, said why, where it
    cannot be used)."""
    path = line.strip()[len("/predict"):].strip()
    if not path:
        err.print("[dim]/predict FILE: the next reply drafts from FILE (the text your request "
                  "edits)[/dim]")
        return None
    if why := m.refuses_prediction():
        err.print(f"[red]error:[/red] /predict: {escape(why)}")
        return None
    try:
        text = _read_text(Path(path).expanduser(), "/predict")
    except SpeceeError as e:
        err.print(f"[red]error:[/red] {e}", markup=True)
        return None
    err.print(f"[dim](the next reply drafts from {path}, {len(text)} characters)[/dim]")
    return text


def _default_slots(model: str, draft: str | None, config, alone, in_slots,
                   draft_given: bool):
    """(loaded LLM, slots, why) for serve without --parallel: loaded with ``draft`` for one
    slot, and where slots pay here (server/slot_count.py) its context opened again with a
    sequence a slot, without the draft."""
    from ..server.slot_count import default_slots

    llm = _load(model, draft, config, measure_now=False)   # see serve
    n, why = default_slots(llm, alone, *in_slots, draft_given=draft_given)
    if n > 1:
        try:
            llm.open_slots(n)
        except SpeceeError as e:   # a KV cache that cannot keep sequences apart
            return llm, 1, str(e)
    return llm, n, why


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
    parallel: Optional[int] = typer.Option(
        None, "--parallel",
        help="Requests decoded at once, each in a slot of one KV cache (--n-ctx tokens each), "
             "their tokens in one batch a step. Above 1: modes plain and spec (drafts from the "
             "context and the prediction; from the draft model too with --draft and a fixed "
             "--gamma N). Default: 4 where this machine's timing says a step of 4 pays and no "
             "draft model would be left out, else 1."),
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

        from ..server.app import ServeConfig, create_app
        from ..server.limits import H11WithDeadline
    except ImportError as e:
        raise SpeceeError(f"specee-cpp serve needs the server extra ({e.name} is missing): "
                          f"pip install 'specee-cpp[server]'") from None

    if not 0 <= port <= 65535:
        raise SpeceeError(f"--port {port}: a port is 0..65535 (0: any free port)")
    import os

    if api_key is None:   # click takes an empty variable for an unset one
        api_key = os.environ.get("SPECEE_CPP_API_KEY")
    if api_key is not None and not api_key.strip():
        # an empty key would turn authentication off without a word
        raise SpeceeError("--api-key (or SPECEE_CPP_API_KEY) is empty: give a key, or leave "
                          "both out to serve without one")
    if parallel is not None and not 1 <= parallel <= MAX_SEQ:
        raise SpeceeError(f"--parallel {parallel}: 1 to {MAX_SEQ} requests at a time (the "
                          f"sequences one llama.cpp context holds)")
    # a slot's decodes share each step's batch with the other slots': no staged ones; its
    # default mode drafts from the context and the prediction, where they pay, and a draft
    # model runs in each slot at a fixed --gamma only (gamma auto prices its drafts with
    # costs measured for one request at a time)
    slot_draft = parallel is not None and parallel > 1 and draft is not None
    given_draft = draft
    model, draft = _default_pair(model, draft) if parallel in (None, 1) or slot_draft \
        else (_default_pair(model, None)[0], None)
    # the mode and options of one request at a time, and of a slot of several
    alone = flags.resolve(draft) if parallel in (None, 1) else None
    in_slots = (flags if flags.mode is not None else replace(flags, mode="spec")).resolve(
        draft if slot_draft else None) if parallel != 1 else None
    if parallel is not None and parallel > 1:
        m, opts = in_slots
        if why := m.refused_with_slots(parallel, opts, draft=slot_draft):
            raise SpeceeError(f"--{why}; serve one request at a time for it")
        if slot_draft and not (isinstance(getattr(opts, "gamma", None), int) and opts.gamma):
            raise SpeceeError(f"--draft with --parallel {parallel}: the slots run the draft "
                              f"model at a fixed --gamma N (mode spec); gamma auto drafts "
                              f"from the context and the prediction alone there")
    sampling = _sampling(temperature, top_k, top_p, seed)
    # refused before the port is taken
    config = _load_config(n_ctx, threads, gpu_layers, n_seq=parallel or 1)
    # bound before loading, so a taken port is one line now, not after a minute of loading
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise SpeceeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # what this machine's timings still lack is taken between requests, so a new machine
    # listens as soon as the models are in (server/worker.py; slots, which have no idle
    # time, take it before they start)
    if parallel is None:
        llm, parallel, why = _default_slots(model, draft, config, alone[0], in_slots,
                                            draft_given=given_draft is not None)
        err.print(f"[dim]--parallel {parallel} (the default here): {escape(why)}[/dim]")
    else:
        llm = _load(model, draft, config, measure_now=False)
    m, opts = in_slots if parallel > 1 else alone
    with llm:
        llm.defer_costs = True   # measured between requests (speculative/idle.py)
        if parallel == 1:   # a slot prepares nothing: it runs no draft model
            m.prepare(llm, opts, status=status_line)
        cfg = ServeConfig(model_name=Path(model).stem if model.endswith(".gguf") else model,
                          mode=m, options=opts, sampling=sampling, api_key=api_key,
                          max_queue=max_queue)
        server = uvicorn.Server(uvicorn.Config(create_app(llm, cfg), log_level="warning",
                                               timeout_graceful_shutdown=5,
                                               http=H11WithDeadline))
        bound = sock.getsockname()
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            err.print(f"[yellow]warning:[/yellow] listening on {host} without --api-key: "
                      f"anyone who can reach this machine can use the model")
        # one line on stdout with the address (scripts and tests read it; port 0 picks one)
        print(f"specee-cpp serving {cfg.model_name} (mode {m.name}"
              + (f", {parallel} slots" if parallel > 1 else "")
              + f") on http://{bound[0]}:{bound[1]}/v1", flush=True)
        server.run(sockets=[sock])



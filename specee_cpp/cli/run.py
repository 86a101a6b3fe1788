"""The everyday commands: generate, chat, serve."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import SpeceeError
from ..text import checked
from .common import (ModeFlags, OptCtx, OptDraft, OptGpu, OptMaxTokens, OptSeed, OptTemp,
                     OptThreads, OptTopK, OptTopP, OptVerbose, _EXIT_WORDS, _default_pair, _load,
                     _load_config, _sampling, app, err, out, print_stats, with_mode_flags)


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

    prompt = _prompt(prompt, prompt_file)
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
            print_stats(done.stats, verbose)


def _prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from ``-p`` or ``--prompt-file`` (exactly one), as text; bytes that are
    not UTF-8 are refused where the prompt is tokenized, with their position."""
    if (prompt is None) == (prompt_file is None):
        raise SpeceeError("give the prompt with -p TEXT or --prompt-file PATH (one of them)")
    if prompt_file is None:
        return prompt
    try:
        data = sys.stdin.buffer.read() if str(prompt_file) == "-" else prompt_file.read_bytes()
    except OSError as e:
        raise SpeceeError(f"cannot read --prompt-file {prompt_file}: {e.strerror or e}") from None
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
    """Multi-turn chat in the terminal. /exit ends it; Ctrl-C stops the current reply."""
    from ..engine.steps import Transcript

    if system is not None:
        checked(system, "--system")
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
        if hasattr(sys.stdin, "reconfigure"):
            # a line that is not UTF-8 reaches the model's check, which names the byte and
            # keeps the session, instead of ending it in input()
            sys.stdin.reconfigure(errors="surrogateescape")
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
                print_stats(reply.stats, verbose)


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
    model, draft = _default_pair(model, draft)
    sampling = _sampling(temperature, top_k, top_p, seed)
    m, opts = flags.resolve(draft)
    config = _load_config(n_ctx, threads, gpu_layers)   # refused before the port is taken
    # bound before loading, so a taken port is one line now, not after a minute of loading
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise SpeceeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    llm = _load(model, draft, config)
    with llm:
        m.prepare(llm, opts, status=err.status)
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
        print(f"specee-cpp serving {cfg.model_name} (mode {m.name}) on "
              f"http://{bound[0]}:{bound[1]}/v1", flush=True)
        server.run(sockets=[sock])



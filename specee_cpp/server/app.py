"""The OpenAI-compatible HTTP app: routes, errors, server-sent events (the key and the
request's limits: limits.py).

Handlers validate everything that can be refused (body, mode, sampling, context) before a
job is queued, then wait for the job's first step before answering, so a request that
fails to start gets a status code, not a broken stream. Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, always one line, never a traceback.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, AsyncIterator

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import SamplingConfig
from ..engine import modes
from ..engine.llm import LLM, check_fits
from ..engine.modes import Mode
from ..engine.steps import Stats, Step, Transcript
from ..errors import FieldError, SpeceeError
from ..speculative.mode import parse_gamma
from .errors import error, error_body
from .limits import Gate
from .schema import ChatRequest, CompletionRequest, Extra
from .worker import END, Job, QueueFull, Worker

DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default for /v1/completions
POLL_S = 0.25                      # how often a waiting handler checks for a gone client
# a stream's time to end after a shutdown signal: under uvicorn's own graceful timeout (5 s),
# and a job stops within one token
SHUTDOWN_GRACE_S = 4.0


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


@dataclass(frozen=True)
class ServeConfig:
    """What the server runs when a request does not say: the ``serve`` command's flags."""

    model_name: str
    mode: Mode
    options: Any
    sampling: SamplingConfig = SamplingConfig()
    api_key: str | None = None
    max_queue: int = 16

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            # an empty key would turn authentication off without a word
            raise SpeceeError("the API key is empty: give a key, or None to serve without one")


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the first offending field (FastAPI lists them all, nested)."""
    e = exc.errors()[0]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}", None
    # a union's member tag ("str", "list[TextPart]", "function-after[...]") is not part of
    # the field's path; a field name never is one (a prefix test would drop "stream")
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    loc = [p for p in loc if p not in _UNION_TAGS and "[" not in p
           and not p.startswith("function-")]
    field = ".".join(loc) or None
    msg = e["msg"].removeprefix("Value error, ")
    if field:
        return f"{field}: {msg} (got {e.get('input')!r})", field
    return msg, None


def specee_stats(mode: Mode, stats: Stats | None) -> dict:
    """Our statistics, in a field standard clients ignore."""
    if stats is None:
        return {"mode": mode.name}
    n_exit = sum(stats.exit_layers.values())
    return {"mode": mode.name, "n_drafted": stats.n_drafted, "n_accept": stats.n_accept,
            "acceptance": stats.acceptance,
            "exit_ratio": round(n_exit / stats.n_gen, 4) if stats.n_gen else 0.0,
            "decode_tps": round(stats.decode_tps, 3), "prefill_tps": round(stats.prefill_tps, 3),
            "note": stats.note}


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


# ---- errors, one line each in OpenAI's shape ------------------------------------------------

async def _invalid(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return error(400, message, param=param)


async def _http(request: Request, exc: StarletteHTTPException):
    return error(exc.status_code, str(exc.detail), kind="not_found_error"
                 if exc.status_code == 404 else "invalid_request_error")


async def _full(request: Request, exc: QueueFull):
    return error(429, str(exc), kind="rate_limit_error",
                 headers={"Retry-After": str(exc.retry_after)})


async def _refused(request: Request, exc: SpeceeError):
    return error(400, str(exc), param=getattr(exc, "param", None))


async def _bug(request: Request, exc: Exception):
    return error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


ERROR_HANDLERS = {RequestValidationError: _invalid, StarletteHTTPException: _http,
                  QueueFull: _full, SpeceeError: _refused, Exception: _bug}


# ---- the served pair: requests become jobs for its one worker -------------------------------

@dataclass
class Server:
    """The loaded pair, what the server runs when a request does not say, and the worker
    thread that decodes (one per app, ``app.state.server``)."""

    llm: LLM
    cfg: ServeConfig
    worker: Worker

    def job(self, body, prompt, chat: bool) -> Job:
        """A request as the worker runs it, refused here if anything about it cannot run."""
        llm, cfg = self.llm, self.cfg
        mode, options = self.mode_of(body.specee)
        base = cfg.sampling
        sampling = SamplingConfig(
            temperature=base.temperature if body.temperature is None else body.temperature,
            top_k=base.top_k if body.top_k is None else body.top_k,
            top_p=base.top_p if body.top_p is None else body.top_p,
            seed=base.seed if body.seed is None else body.seed)
        # tokenized once: the count checked here is what the worker decodes
        tokens = llm.prompt_tokens(prompt, chat=chat)
        n_prompt = len(tokens)
        limit = body.limit()
        if limit is None:   # chat: up to the context's end; completions: OpenAI's 16
            limit = max(llm.n_ctx - n_prompt, 1) if chat else DEFAULT_COMPLETION_TOKENS
        check_fits(n_prompt, limit, llm.n_ctx)
        predicted = None
        if body.prediction is not None:
            if why := mode.refuses_prediction():
                raise FieldError("prediction", f"prediction: {why}")
            try:
                predicted = llm.prediction_tokens(body.prediction.text())
            except SpeceeError as e:
                raise FieldError("prediction", str(e)) from None
        return Job(prompt=tokens, max_tokens=limit, sampling=sampling,
                   stops=body.stops(), mode=mode, options=options,
                   ignore_eos=bool(body.specee and body.specee.ignore_eos),
                   prediction=predicted)

    def mode_of(self, extra: Extra | None) -> tuple[Mode, Any]:
        cfg = self.cfg
        given = extra is not None and (extra.mode is not None or extra.gamma is not None)
        mode = modes.get(extra.mode) if given and extra.mode else cfg.mode
        n = self.worker.slots
        if why := mode.refused_with_slots(n, draft=self.llm.slots_draft):
            raise FieldError("specee.mode", f"{why}; start the server with --parallel 1 "
                                            f"for it")
        if not given:
            return cfg.mode, cfg.options
        if mode.needs_draft_in(n > 1) and self.llm.draft_path is None:
            raise SpeceeError(f"specee.mode {mode.name} needs a draft model; start the server "
                              f"with --draft")
        options = cfg.options if mode is cfg.mode else mode.options()
        if extra.gamma is not None:
            if "gamma" not in {f.name for f in fields(options)}:
                raise SpeceeError(f"specee.gamma applies to mode spec, not {mode.name}")
            options = replace(options, gamma=parse_gamma(str(extra.gamma)))
            if why := mode.refused_with_slots(n, options, draft=self.llm.slots_draft):
                raise FieldError("specee.gamma", f"{why}; start the server with --parallel 1 "
                                                 f"for it")
        return mode, options

    async def serve(self, body, request: Request, prompt, chat: bool):
        """Queue the request, wait for its first step (a request that fails to start gets a
        status code, not a broken stream), then stream or answer whole."""
        # tokenizing a long prompt and rendering a model's template take time: off the event
        # loop, which serves every other client meanwhile
        job = await asyncio.to_thread(self.job, body, prompt, chat)
        self.worker.submit(job)
        getter: asyncio.Task | None = None

        async def next_item(poll: bool = True):
            """The job's next item; while waiting, a client that left cancels the job."""
            nonlocal getter
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({getter}, timeout=POLL_S if poll else None)
                if done:
                    item, getter = getter.result(), None
                    return item
                if await request.is_disconnected():
                    job.stop()
                    raise ClientGone
                if AppStatus.should_exit:   # shutting down: answer with what is done
                    job.stop()

        try:
            first = await next_item()
        except ClientGone:
            return error(499, "client closed the request")
        if first is END:
            return error(503, "the request was cancelled before it started", kind="server_error")
        if isinstance(first, Exception):
            await _drain(job)
            raise first
        ids = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
               "created": int(time.time()), "model": self.cfg.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # on shutdown (SIGTERM) the stream is not cut: its job stops within a token and
            # the stream ends as streams do, with a finish reason and [DONE]
            shutdown = anyio.Event()
            return EventSourceResponse(
                _sse(job, first, ids, chat, include_usage, shutdown), ping=15,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)
        done = Transcript()
        item = first
        try:
            while item is not END:
                if isinstance(item, Exception):
                    raise item
                done.add(item)
                item = await next_item()
        except ClientGone:
            return error(499, "client closed the request")
        return _response(done, job, ids, chat)


def served(request: Request) -> Server:
    """The routes' dependency: the app's `Server`."""
    return request.app.state.server


# ---- routes ---------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health(s: Server = Depends(served)):
    c, w = s.worker.counters, s.worker
    return {"status": "ok", "model": s.cfg.model_name, "mode": s.cfg.mode.name,
            "busy": w.busy, "slots": w.slots, "running": w.running, "waiting": w.waiting,
            "max_queue": w.max_queue,
            "served": c.served, "failed": c.failed, "cancelled": c.cancelled,
            "refused": c.refused, "last_cancel": c.last_cancel}


@router.get("/v1/models")
async def list_models(s: Server = Depends(served)):
    llm = s.llm
    entry = {"id": s.cfg.model_name, "object": "model", "created": _created(llm),
             "owned_by": "specee-cpp",
             "specee": {"path": str(llm.model.path), "mode": s.cfg.mode.name,
                        "draft": str(llm.draft_path) if llm.draft_path else None}}
    return {"object": "list", "data": [entry]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, s: Server = Depends(served)):
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.text()} for m in body.messages]
    return await s.serve(body, request, messages, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      s: Server = Depends(served)):
    return await s.serve(body, request, body.text(), chat=False)


def create_app(llm: LLM, cfg: ServeConfig) -> FastAPI:
    """The app serving ``llm``; the worker's threads run its requests in arrival order."""
    from ..engine.idle import idle_work
    from ..speculative.mode import idle_costs_job

    def log(line: str) -> None:
        print(f"specee-cpp: {line}", file=sys.stderr, flush=True)

    idle = idle_work(llm, idle_costs_job(llm, cfg.mode, cfg.options, log=log), log)
    worker = Worker(llm, max_queue=cfg.max_queue, idle=idle)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)   # stops the running job; the thread ends

    app = FastAPI(title="specee-cpp", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.worker = worker
    app.state.server = Server(llm, cfg, worker)
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)
    app.add_middleware(Gate, api_key=cfg.api_key)   # the key, then the body's limits
    app.include_router(router)
    return app


async def _sse(job: Job, first: Step, ids: dict, chat: bool, include_usage: bool,
               shutdown: anyio.Event | None = None) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    finished = False

    async def stop_on_shutdown():
        await shutdown.wait()
        job.stop()

    watcher = asyncio.ensure_future(stop_on_shutdown()) if shutdown is not None else None

    def chunk(text: str | None, reason: str | None = None, role: bool = False,
              **extra) -> str:
        if chat:
            delta = ({"role": "assistant"} if role else {}) | \
                    ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": reason}
        return json.dumps({**ids, "object": obj, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk("", role=True)
        item, stats = first, None
        while item is not END:
            if isinstance(item, Exception):   # failed mid-way: say so in the stream
                yield json.dumps(error_body(str(item), kind="server_error"))
                break
            if item.text:
                yield chunk(item.text)
            if item.finish_reason is not None:
                stats = item.stats
                yield chunk(None if chat else "", reason=_finish(item.finish_reason),
                            specee=specee_stats(job.mode, stats))
            item = await job.events.get()
        finished = True
        if stats is None and shutdown is not None and shutdown.is_set():
            yield chunk(None if chat else "", reason="stop",
                        specee={**specee_stats(job.mode, None),
                                "note": "stopped: the server is shutting down"})
        if include_usage and stats is not None:
            yield json.dumps({**ids, "object": obj, "choices": [], "usage": _usage(stats)})
        yield "[DONE]"
    finally:
        if watcher is not None:
            watcher.cancel()
        if not finished:
            job.stop()     # the client left: the worker decodes no further token


def _response(done: Transcript, job: Job, ids: dict, chat: bool) -> dict:
    stats = done.stats
    reason = _finish(stats.finish_reason if stats else "length")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": reason}
    return {**ids, "object": "chat.completion" if chat else "text_completion",
            "choices": [choice], "usage": _usage(stats),
            "specee": specee_stats(job.mode, stats)}


def _usage(stats: Stats | None) -> dict:
    p, c = (stats.n_prompt, stats.n_gen) if stats else (0, 0)
    usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
             "prompt_tokens_details": {"cached_tokens": stats.n_cached if stats else 0}}
    if stats is not None and stats.prediction is not None:
        accepted, rejected = stats.prediction
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": rejected}
    return usage


def _created(llm: LLM) -> int:
    try:
        return int(llm.model.path.stat().st_mtime)
    except OSError:
        return 0


async def _drain(job: Job) -> None:
    """Wait for a failed job's END, so its slot is free when the error is answered."""
    while await job.events.get() is not END:
        pass

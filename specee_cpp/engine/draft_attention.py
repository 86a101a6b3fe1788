"""The draft's flash attention, chosen by measuring it on this machine.

llama.cpp turns flash attention on by default where the backend has it. For the 0.5B draft on
a 2-core AMX Xeon that made a token after 1024 cached tokens cost 27.3 ms against 13.4 ms
without, while the 1.5B target was faster with it: which is cheaper depends on the model's
shape and the machine's kernels, so every mode that decodes the draft runs it with the
setting measured here, once per draft file and machine, cached beside the cost tables. The
target keeps llama.cpp's default (plain decoding runs no measurement).
"""
from __future__ import annotations

import json
import time

from ..config import COST_CONTEXTS, COST_PROMPT
from ..paths import home, write_text_atomic
from .timing import Steps, run_steps, time_in_turn_steps

VERSION = 1   # part of the cache key: a changed method measures again


def time_attention(model, n_threads: int, tokens: list[int], contexts=COST_CONTEXTS,
                   n_batch: int = 512, decodes: int = 12, warmup: int = 2,
                   clock=time.perf_counter) -> dict:
    """:func:`time_attention_steps` in one go."""
    return run_steps(time_attention_steps(model, n_threads, tokens, contexts, n_batch,
                                          decodes, warmup, clock))


def time_attention_steps(model, n_threads: int, tokens: list[int], contexts=COST_CONTEXTS,
                         n_batch: int = 512, decodes: int = 12, warmup: int = 2,
                         clock=time.perf_counter) -> Steps:
    """Median seconds of one decoded token of ``model`` with llama.cpp's flash attention at
    its default (on where the backend has it) and off, after each of ``contexts`` cached
    tokens (``tokens`` repeated): {"contexts": [...], "default": [...], "off": [...]}.

    Two contexts, filled alike, decode in turn, token by token (a machine slowing down
    slows both)."""
    from ..bindings import Batch, Context

    contexts = sorted(contexts)
    settings = {"default": None, "off": False}
    ctxs: dict = {}
    batch = Batch(n_batch)
    out: dict = {"contexts": contexts, "default": [], "off": []}
    try:
        for name, fa in settings.items():
            ctxs[name] = Context(model, n_ctx=contexts[-1] + 1, n_batch=n_batch,
                                 n_threads=n_threads, flash_attn=fa)
        fill = (tokens * (contexts[-1] // max(len(tokens), 1) + 1))[:contexts[-1]]
        filled = 0
        for c in contexts:
            for ctx in ctxs.values():
                for s in range(filled, c, n_batch):
                    batch.set(fill[s:min(s + n_batch, c)], s)
                    ctx.decode(batch)
                    yield "the draft's attention: filling its cache"
            filled = c
            seen = yield from time_in_turn_steps({name: (ctx, None) for name, ctx in ctxs.items()},
                                                 batch, fill, c, decodes, warmup, clock=clock)
            for name in settings:
                out[name].append(seen[name])
    finally:
        for ctx in ctxs.values():
            ctx.close()
        batch.close()
    return out


def choose(model, n_threads: int, tokens: list[int],
           n_batch: int) -> tuple[bool | None, dict]:
    """(flash attention setting for the draft's context, what was timed): off where its
    tokens were cheaper without it over the cost table's contexts (summed), else llama.cpp's
    default (None). Seconds; 12 tokens each way per context, in contexts of its own (the
    draft's own may be smaller)."""
    return run_steps(choose_steps(model, n_threads, tokens, n_batch))


def choose_steps(model, n_threads: int, tokens: list[int], n_batch: int) -> Steps:
    """:func:`choose` a decode at a time."""
    seen = yield from time_attention_steps(model, n_threads, tokens, COST_CONTEXTS,
                                           n_batch=n_batch)
    return (False if sum(seen["off"]) < sum(seen["default"]) else None), seen


def draft_attention(llm) -> tuple[bool | None, dict]:
    """The draft's flash attention on this machine, applied to its context: (setting, what
    was timed). Measured once per draft file and machine (seconds: a token each way after 128
    and 1024 cached tokens), cached under ``$SPECEE_CPP_HOME/costs``, so that every mode that
    drafts runs with it, a cost table or not (early exit's draft provider decodes the draft
    on every token)."""
    return run_steps(draft_attention_steps(llm))


def draft_attention_steps(llm) -> Steps:
    """:func:`draft_attention`, a measurement taken a decode at a time."""
    from ..provenance import machine, machine_id

    key = ("attention", llm.draft_path)
    got = llm.cached(key, lambda: None)
    if got is None:
        llm.forget(key)
        where = machine(llm.config.threads)
        path = home() / "costs" / (f"attention-{llm.draft_sha256()[:12]}-m{machine_id(where)}"
                                   f"-v{VERSION}.json")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("flash_attn") not in (False, None) or not isinstance(data.get("seen"),
                                                                              dict):
                raise ValueError(path)
            got = data["flash_attn"], data["seen"]
        except (OSError, ValueError, AttributeError):   # none yet, torn, another layout
            got = yield from choose_steps(llm.dft.model, llm.config.threads,
                                          llm.prompt_tokens(COST_PROMPT),
                                          n_batch=llm.config.n_batch)
            write_text_atomic(path, json.dumps({"flash_attn": got[0], "seen": got[1]}))
        llm.remember(key, got)
    fa, seen = got
    llm.set_draft_flash_attn(fa)
    return fa, seen


def describe(flash_attn: bool | None, seen: dict, digits: int = 1) -> str:
    """The choice and what was timed, in one phrase (``costs``, the GPU check's report)."""
    def ms(xs):
        return "/".join(f"{1e3 * x:.{digits}f}" for x in xs)

    return (f"flash attention {'off' if flash_attn is False else 'at llama.cpp default'} "
            f"(a draft token {ms(seen['default'])} ms with the default, {ms(seen['off'])} ms "
            f"off, at {'/'.join(map(str, seen['contexts']))} tokens of context)")


def use_draft_attention(llm, flash_attn: bool | None) -> None:
    """Run the draft with this flash-attention setting instead of measuring (a draft that is
    the target's own file keeps its numerics with the target's setting, None)."""
    llm.remember(("attention", llm.draft_path), (flash_attn, {}))
    llm.set_draft_flash_attn(flash_attn)

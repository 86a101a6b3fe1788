"""Draft-then-verify speculative decoding, the draft length chosen each round by a policy
(``spec.policies``: fixed gamma, baselines, ours). The loop is the algorithm, four
steps a round (plan, draft, verify, learn); `Phases` keeps the clock out of it.

Each round the draft proposes up to gamma tokens after the last emitted one, the target scores
all of them in one batch, the longest acceptable prefix is kept plus one token from the
target, and both KV caches are cut back to what was emitted. Greedy decoding is lossless
(up to the target's batched arithmetic, see tests); sampling uses the standard rejection
rule, so the output distribution is the target's.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol

import numpy as np

from ..config import SamplingConfig
from ..engine.sampling import probs
from ..engine.sequence import Sequence, common_prefix
from ..engine.steps import Step
from ..errors import SpeceeError
from .policies import ROUND_CATCH_UP, DraftPolicy, FixedGamma
from .suffix import ContextSource


def accept_drafts(draft: list[int], q: list[np.ndarray], p: np.ndarray,
                  rng: np.random.Generator, greedy: bool) -> tuple[int, int]:
    """(number of drafted tokens accepted, the target's token after them).

    ``p`` holds the target's distributions after each drafted prefix (gamma + 1 rows),
    ``q`` the draft's distributions its tokens were drawn from.
    """
    for i, tok in enumerate(draft):
        if greedy:
            best = int(np.argmax(p[i]))
            if tok != best:
                return i, best
            continue
        # Accept x ~ q with probability min(1, p(x)/q(x)); on rejection draw from the
        # residual max(0, p - q), which makes the emitted token exactly p-distributed.
        if rng.random() * q[i][tok] <= p[i][tok]:
            continue
        resid = np.maximum(p[i] - q[i], 0.0)
        total = resid.sum()
        resid = resid / total if total > 0 else p[i]
        return i, int(rng.choice(len(resid), p=resid))
    last = p[len(draft)]
    return len(draft), int(np.argmax(last)) if greedy else int(rng.choice(len(last), p=last))


def one_hot(token: int, seq: Sequence) -> np.ndarray:
    """The distribution a deterministic (free) draft token was drawn from, for the rejection
    rule: accepting it with probability p(token) keeps the output exactly p-distributed."""
    q = np.zeros(seq.ctx.model.n_vocab)
    q[token] = 1.0
    return q


def draft_room(max_new: int | None, n_emitted: int) -> int | None:
    """The most tokens a round may draft when ``n_emitted`` of at most ``max_new`` tokens are
    out (None: no limit). A round emits its accepted drafts and one token more: drafting past
    the limit would pay to verify tokens that are never emitted."""
    return None if max_new is None else max(0, max_new - n_emitted - 1)


def accept_greedy(draft: list[int], target_at: Callable[[int], int]) -> tuple[int, int]:
    """Greedy verification: (drafted tokens equal to the target's argmax, the target's token
    after them). ``target_at(i)`` is the target's greedy token after drafted prefix i; it is
    asked only up to the first mismatch."""
    for i, tok in enumerate(draft):
        best = target_at(i)
        if tok != best:
            return i, best
    return len(draft), target_at(len(draft))


def draft_confidence(logits: np.ndarray) -> tuple[float, float]:
    """(top-1 probability, entropy in nats) of the draft's full softmax, from logits already
    copied (sampling, a verifier); greedy rounds read both in C (``Sequence.confidence``)."""
    z = logits.astype(np.float32) - np.float32(logits.max())
    e = np.exp(z)
    total = float(e.sum())
    # entropy = log S - sum(e * z) / S, without forming p; a reduced draft head leaves -inf
    # logits (e = 0), whose terms are 0, not 0 * -inf
    z[e == 0] = 0
    return 1.0 / total, float(np.log(total) - float(e @ z) / total)


class Verifier(Protocol):
    """Scores one round's batch in place of the full-depth decode (``hyper/``: SpecEE's early
    exit inside verification). Greedy only.

    ``tokens`` are the last emitted token and the drafted ones; ``rows`` the draft's logits
    at each of those positions that the round read (the last drafted token's may be
    missing: the draft has not decoded it; ``dft`` can). Returns the target's greedy token
    after each drafted prefix (``target_at(i)``, asked up to the first mismatch) and the
    layer the batch exited at (None: full depth). The target's cache holds ``tokens``
    afterwards, complete at every layer, as after ``decode``."""

    def __call__(self, tgt: Sequence, tokens: list[int], rows: list[np.ndarray],
                 dft: Sequence) -> tuple[Callable[[int], int], int | None]: ...


class Phases:
    """Seconds per phase of a round, so that the loop reads like the algorithm:
    ``with phases("draft"): ...``. Phases nest exclusively: time spent in an inner phase
    (a control decision taken while drafting) is not counted in the outer one."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.seconds, self._stack = clock, {}, []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        now = self.clock()
        if self._stack:  # pause the enclosing phase
            outer, since = self._stack[-1]
            self.seconds[outer] = self.seconds.get(outer, 0.0) + now - since
        self._stack.append((name, now))
        try:
            yield
        finally:
            end = self.clock()
            _, since = self._stack.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + end - since
            if self._stack:  # resume it
                self._stack[-1] = (self._stack[-1][0], end)


def generate_spec(tgt: Sequence, dft: Sequence | None, prompt: list[int],
                  policy: DraftPolicy | int, sampling: SamplingConfig,
                  trace: Callable[[dict], None] | None = None,
                  context: ContextSource | None = None,
                  verifier: Verifier | None = None, max_new: int | None = None,
                  is_eog: Callable[[int], bool] | None = None) -> Iterator[Step]:
    """Speculative decoding; ``policy`` says how many tokens to draft each round (an int is
    a fixed gamma). A round with nothing drafted is a plain decoding step, and the draft
    model is brought up to date (one batch) when a round drafts again. ``trace``, if given,
    receives one record per drafted round (the draft's top-1 probability and entropy per
    drafted token, the accepted count, draft and verify seconds): the profiling data of a
    draft-length controller. ``context``, if given, is a free drafter from the context that
    takes a round whenever its proposal is predicted to beat both plain decoding and the
    policy's best predicted model-drafted round; the draft model (``dft``, None for a policy
    that never drafts) serves the others. ``verifier``, if
    given (greedy only), scores the rounds the draft model drafted instead of a full-depth
    decode; the other rounds stay exact. ``max_new``, if given, is the most tokens the
    caller will take: no round drafts past it (the stream may still be stopped earlier);
    ``is_eog``, if given, ends a model draft at an end-of-generation token (the free
    drafter cuts its own, ``ContextSource.is_eog``)."""
    if isinstance(policy, int):
        policy = FixedGamma(policy)
    rng = np.random.default_rng(sampling.seed)
    greedy = sampling.greedy
    if verifier is not None and not greedy:
        raise SpeceeError(f"a verifier scores greedy rounds only, not temperature "
                          f"{sampling.temperature}")
    confidence = policy.needs_confidence or trace is not None

    def choose(seq: Sequence, logits: np.ndarray | None = None) -> tuple[int, np.ndarray | None]:
        """The next token from ``seq``'s last output (or from ``logits`` already read) and,
        when sampling, the distribution it was drawn from. Greedy takes the argmax in C
        unless the logits were needed anyway (the draft's confidence)."""
        if greedy:
            return (seq.argmax() if logits is None else int(np.argmax(logits))), None
        dist = probs(seq.logits() if logits is None else logits, sampling)
        return int(rng.choice(len(dist), p=dist)), dist

    t0 = time.perf_counter()
    tgt.prefill(prompt, read=False)
    token, _ = choose(tgt)
    if context is not None:
        context.extend(prompt + [token])
    if dft is not None:
        # the draft reads the prompt up front, as part of prefill (llama.cpp's tools count it
        # there too), where the policy says so; a policy that may never draft, whose guard
        # holds it at plain decoding for now (drafting lost in the last generations) or that
        # cannot win the read back within the caller's limit leaves it to the first drafted
        # round: a chat turn where drafting does not pay keeps plain's first-token latency
        n_read = len(prompt) - min(common_prefix(dft.tokens, prompt), len(prompt) - 1)
        room = draft_room(max_new, 1)
        policy.at_context(len(prompt), n_read + 1, room)
        if policy.reads_prompt(n_read + 1, room):
            t_read = time.perf_counter()
            dft.prefill(prompt)
            policy.prompt_read(time.perf_counter() - t_read, n_read)
    yield Step(token=token, timings={"prefill": time.perf_counter() - t0})
    n_out = 1
    while True:
        base_t = len(tgt.tokens)
        room = draft_room(max_new, n_out)
        ph = Phases()
        # 1. how many tokens to draft (0: a plain step)
        with ph("control"):
            # the draft is behind by what plain steps and free drafts emitted since it ran
            behind = len(tgt.tokens) + 1 - len(dft.tokens) if dft is not None else 0
            policy.at_context(base_t, behind, room)
            # a free draft from the context takes the round when it beats plain decoding
            # and the draft model's best predicted round; else the policy decides
            free = context.plan(base_t + 1, room) if context is not None else []
            if free and policy.predicted_tps() > context.expected_tps:
                free = []
            g_max = 0 if free else policy.plan()
            if room is not None:
                g_max = min(g_max, room)
        # 2. draft them, one at a time, while the policy keeps them
        draft, conf = list(free), []
        rows: list[np.ndarray] = []   # the draft's logits at each position (for a verifier)
        # a free draft's tokens were "drawn" from one-hot distributions (the rejection rule's
        # q); greedy verification reads no q
        q = [None if greedy else one_hot(t, tgt) for t in free]
        with ph("draft"):
            if g_max > 0:
                # catch the draft up on everything emitted since it last ran (one batch):
                # after a drafted round 1-2 tokens; after plain steps, free drafts or a
                # deferred prompt it can be hundreds, timed apart (the guard charges it to
                # the round, except after its own wait: Guard)
                with ph("catch_up" if behind > ROUND_CATCH_UP else "draft"):
                    dft.prefill(tgt.tokens + [token], read=False)
            for i in range(g_max):
                lg, tok = None, None
                if verifier is not None or (confidence and not greedy):
                    lg = dft.logits()
                    rows.append(lg)
                if confidence:
                    if lg is None:   # greedy: token and confidence in C, no logits copied
                        tok, top1, ent = dft.confidence()
                    else:
                        top1, ent = draft_confidence(lg)
                    with ph("control"):
                        ok = policy.keep(i, top1, ent)
                    if not ok:
                        break
                    conf.append((top1, ent))
                tok, dist = (tok, None) if tok is not None else choose(dft, lg)
                draft.append(tok)
                q.append(dist)
                if i == g_max - 1 or (is_eog is not None and is_eog(tok)):
                    break
                with ph("control"):
                    go_on = policy.more(i)
                if not go_on:
                    break
                dft.decode([tok])
        # 3. verify: the target scores every drafted token in one batch, keeps the
        #    longest acceptable prefix and adds its own next token
        exit_layer = None
        with ph("verify" if draft else "decode"):
            if not draft:
                tgt.decode([token])
                nxt, _ = choose(tgt)
                n_acc = 0
            else:
                if verifier is not None and not free:
                    target_at, exit_layer = verifier(tgt, [token] + draft, rows, dft)
                else:
                    tgt.decode([token] + draft, all_outputs=True)
                    target_at = tgt.argmax   # no logits copied: the argmax per position, in C
                if greedy:
                    n_acc, nxt = accept_greedy(draft, target_at)
                else:
                    p = np.stack([probs(tgt.logits(j), sampling)
                                  for j in range(len(draft) + 1)])
                    n_acc, nxt = accept_drafts(draft, q, p, rng, greedy)
                # keep what was emitted: the target holds token + accepted drafts, the
                # draft too
                tgt.rewind(base_t + 1 + n_acc)
                if dft is not None:
                    dft.rewind(min(len(dft.tokens), base_t + 1 + n_acc))
        # 4. the source that drafted learns from the round (its own time is control)
        round_s = sum(ph.seconds.values())
        with ph("control"):
            if free:
                context.update(len(free), n_acc, round_s)
            else:
                if context is not None and g_max == 0:   # neither source drafted
                    context.plain_step(round_s)
                policy.update(len(draft), n_acc, [c[0] for c in conf], [c[1] for c in conf],
                              round_s, tried=g_max > 0, catch_up=ph.seconds.get("catch_up", 0.0))
                # what a full-depth batch cost (the context drafter times its own rounds and
                # the plain steps where it runs; an early-exit verifier's batches are not
                # the table's)
                if draft and verifier is None:
                    policy.verified(len(draft) + 1, ph.seconds["verify"])
                elif not draft and context is None:
                    policy.verified(1, ph.seconds["decode"])
            if context is not None:
                context.extend(draft[:n_acc] + [nxt], emitted=True)
        if trace is not None and draft and not free:
            trace({"gamma": len(draft), "draft_top1": [round(c[0], 5) for c in conf],
                   "draft_entropy": [round(c[1], 5) for c in conf], "n_accept": n_acc,
                   "t_draft": ph.seconds["draft"], "t_verify": ph.seconds["verify"]})
        n_out += n_acc + 1
        for tok in draft[:n_acc]:
            yield Step(token=tok, exit_layer=exit_layer)
        # a plain step may follow a draft whose first token was dropped (g_max > 0)
        timings = {k: ph.seconds.get(k, 0.0) for k in
                   ("draft", "verify" if draft else "decode", "control")}
        if "catch_up" in ph.seconds:
            timings["catch_up"] = ph.seconds["catch_up"]
        yield Step(token=nxt, exit_layer=exit_layer, n_drafted=len(draft), n_accept=n_acc,
                   source=(context.source if free else "model") if draft else None,
                   timings=timings)
        token = nxt

"""Draft-then-verify speculative decoding, the draft length chosen each round by a policy
(``speculative.policies``: fixed gamma, baselines, ours). The loop is the algorithm, four
steps a round (plan, draft, verify, learn: `SpecLoop`); `Phases` keeps the clock out of it.

Each round the draft proposes up to gamma tokens after the last emitted one, the target scores
all of them in one batch, the longest acceptable prefix is kept plus one token from the
target, and both KV caches are cut back to what was emitted. Greedy decoding is lossless
(up to the target's batched arithmetic, see tests); sampling uses the standard rejection
rule, so the output distribution is the target's.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from ..config import SamplingConfig
from ..engine.drafts import accept_greedy, draft_room
from ..engine.sampling import probs
from ..engine.sequence import Sequence, common_prefix
from ..engine.steps import Step
from ..errors import SpeceeError
from .policies import ROUND_CATCH_UP, DraftPolicy, FixedGamma, Outcome, RoundAt
from .context_drafter import ContextSource


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
    """Scores one round's batch in place of the full-depth decode (``spec_ee/``: SpecEE's early
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


@dataclass
class Round:
    """One round of the loop: what was planned, drafted and kept, and its clock."""

    base: int                 # target tokens before the round (its last emitted one not in)
    behind: int               # tokens the draft model has not read yet
    free: list[int]           # a free draft from the context (empty: the policy's round)
    free_source: str          # who proposed ``free`` (the context drafter's ``source``)
    g_max: int                # most tokens the draft model may draft (0 with a free draft)
    ph: Phases = field(default_factory=Phases)
    room: int | None = None   # most tokens the round may draft (None: no caller's limit)
    tail: int = 0             # the draft's last tokens that are the prediction's, where the
    # draft model's tokens rejoined it (ContextSource.rejoin)
    draft: list[int] = field(default_factory=list)
    q: list = field(default_factory=list)         # the distributions drafts were drawn from
    conf: list[tuple[float, float]] = field(default_factory=list)   # (top-1, entropy) each
    rows: list[np.ndarray] = field(default_factory=list)   # the draft's logits (a verifier's)
    n_acc: int = 0
    nxt: int = -1
    exit_layer: int | None = None

    @property
    def source(self) -> str | None:
        if not self.draft:
            return None
        return self.free_source if self.free else "model+prediction" if self.tail else "model"

    def timings(self) -> dict[str, float]:
        # a plain step may follow a draft whose first token was dropped (g_max > 0)
        keys = ("draft", "verify" if self.draft else "decode", "control")
        t = {k: self.ph.seconds.get(k, 0.0) for k in keys}
        if "catch_up" in self.ph.seconds:
            t["catch_up"] = self.ph.seconds["catch_up"]
        return t


class SpecLoop:
    """The parts of speculative decoding that `generate_spec` runs in order each round:
    ``plan`` (how many tokens, from where), ``draft``, ``verify`` and ``learn``. Each can be
    driven alone (tests), on the two sequences and the policy given."""

    def __init__(self, tgt: Sequence, dft: Sequence | None, policy: DraftPolicy,
                 sampling: SamplingConfig, context: ContextSource | None = None,
                 verifier: Verifier | None = None, max_new: int | None = None,
                 is_eog: Callable[[int], bool] | None = None, confidence: bool = False):
        if verifier is not None and not sampling.greedy:
            raise SpeceeError(f"a verifier scores greedy rounds only, not temperature "
                              f"{sampling.temperature}")
        self.tgt, self.dft, self.policy, self.sampling = tgt, dft, policy, sampling
        self.context, self.verifier, self.max_new, self.is_eog = context, verifier, max_new, is_eog
        self.greedy = sampling.greedy
        self.confidence = policy.needs_confidence or confidence
        self.rng = np.random.default_rng(sampling.seed)

    def choose(self, seq: Sequence, logits: np.ndarray | None = None
               ) -> tuple[int, np.ndarray | None]:
        """The next token from ``seq``'s last output (or from ``logits`` already read) and,
        when sampling, the distribution it was drawn from. Greedy takes the argmax in C
        unless the logits were needed anyway (the draft's confidence)."""
        if self.greedy:
            return (seq.argmax() if logits is None else int(np.argmax(logits))), None
        dist = probs(seq.logits() if logits is None else logits, self.sampling)
        return int(self.rng.choice(len(dist), p=dist)), dist

    def start(self, prompt: list[int]) -> int:
        """Prefill the target with ``prompt``; its first token. The draft reads the prompt up
        front (counted in prefill, as llama.cpp's tools count it) only where the policy says
        so: a policy that may never draft, whose guard holds it at plain decoding or that
        cannot win the read back within the caller's limit leaves it to the first drafted
        round, and a turn where drafting does not pay keeps plain's first-token latency."""
        self.tgt.prefill(prompt, read=False)
        token, _ = self.choose(self.tgt)
        if self.context is not None:
            self.context.extend(prompt + [token])
            self.context.output_began(token)
        if self.dft is not None:
            n_read = len(prompt) - min(common_prefix(self.dft.tokens, prompt), len(prompt) - 1)
            room = draft_room(self.max_new, 1)
            if self.policy.reads_prompt(RoundAt(len(prompt), n_read + 1, room)):
                t = time.perf_counter()
                self.dft.prefill(prompt)
                self.policy.prompt_read(time.perf_counter() - t, n_read)
        return token

    def plan(self, n_out: int) -> Round:
        """How many tokens to draft after ``n_out`` emitted ones, and from where: a free draft
        from the context takes the round when it beats plain decoding and the draft model's
        best predicted round; else the policy decides (0: a plain step)."""
        base, room = len(self.tgt.tokens), draft_room(self.max_new, n_out)
        ph = Phases()
        with ph("control"):
            # the draft is behind by what plain steps and free drafts emitted since it ran
            behind = base + 1 - len(self.dft.tokens) if self.dft is not None else 0
            free = self.context.plan(base + 1, room) if self.context is not None else []
            g_max = self.policy.plan(RoundAt(base, behind, room),
                                     rival_tps=self.context.expected_tps if free else None)
            if g_max:
                free = []
            if room is not None:
                g_max = min(g_max, room)
        return Round(base, behind, free, self.context.source if free else "", g_max, ph,
                     room)

    def draft(self, r: Round, token: int) -> None:
        """Fill ``r.draft``: the free draft, or the draft model's tokens one at a time while
        the policy keeps them."""
        r.draft = list(r.free)
        # a free draft's tokens were "drawn" from one-hot distributions (the rejection rule's
        # q); greedy verification reads no q
        r.q = [None if self.greedy else one_hot(t, self.tgt) for t in r.free]
        ph, dft, policy = r.ph, self.dft, self.policy
        with ph("draft"):
            if r.g_max == 0:
                return
            # catch the draft up on everything emitted since it last ran (one batch): after a
            # drafted round 1-2 tokens; after plain steps, free drafts or a deferred prompt it
            # can be hundreds, timed apart (the guard charges it to the round)
            with ph("catch_up" if r.behind > ROUND_CATCH_UP else "draft"):
                dft.prefill(self.tgt.tokens + [token], read=False)
            for i in range(r.g_max):
                lg, tok = None, None
                if self.verifier is not None or (self.confidence and not self.greedy):
                    lg = dft.logits()
                    r.rows.append(lg)
                if self.confidence:
                    if lg is None:   # greedy: token and confidence in C, no logits copied
                        tok, top1, ent = dft.confidence()
                    else:
                        top1, ent = draft_confidence(lg)
                    with ph("control"):
                        keep = policy.keep(i, top1, ent)
                    if not keep:
                        return
                    r.conf.append((top1, ent))
                tok, dist = (tok, None) if tok is not None else self.choose(dft, lg)
                r.draft.append(tok)
                r.q.append(dist)
                if self.is_eog is not None and self.is_eog(tok):
                    return
                if self.context is not None and self.verifier is None and self._rejoin(r):
                    return
                if i == r.g_max - 1:
                    return
                with ph("control"):
                    more = policy.more(i)
                if not more:
                    return
                dft.decode([tok])

    def _rejoin(self, r: Round) -> bool:
        """Whether the draft model's tokens so far bring the output back to the prediction
        it left, the prediction's continuation then added to the draft (``r.tail``)."""
        with r.ph("control"):
            tail = self.context.rejoin(r.draft, r.room)
        r.draft += tail
        r.q += [None if self.greedy else one_hot(t, self.tgt) for t in tail]
        r.tail = len(tail)
        return bool(tail)

    def verify(self, r: Round, token: int) -> None:
        """The target scores ``token`` and the drafted tokens in one batch; the longest
        acceptable prefix is kept (``r.n_acc``) with the target's own next token (``r.nxt``),
        and both caches are cut back to what was emitted. Nothing drafted: a plain step."""
        tgt, dft = self.tgt, self.dft
        with r.ph("verify" if r.draft else "decode"):
            if not r.draft:
                tgt.decode([token])
                r.nxt, _ = self.choose(tgt)
                return
            if self.verifier is not None and not r.free:
                target_at, r.exit_layer = self.verifier(tgt, [token] + r.draft, r.rows, dft)
            else:
                tgt.decode([token] + r.draft, all_outputs=True)
                target_at = tgt.argmax   # no logits copied: the argmax per position, in C
            if self.greedy:
                r.n_acc, r.nxt = accept_greedy(r.draft, target_at)
            else:
                p = np.stack([probs(tgt.logits(j), self.sampling)
                              for j in range(len(r.draft) + 1)])
                r.n_acc, r.nxt = accept_drafts(r.draft, r.q, p, self.rng, self.greedy)
            tgt.rewind(r.base + 1 + r.n_acc)
            if dft is not None:
                dft.rewind(min(len(dft.tokens), r.base + 1 + r.n_acc))

    def learn(self, r: Round) -> None:
        """The source that drafted learns from the round's outcome and seconds (its own time
        counts as control); the context drafter reads what was emitted."""
        round_s = sum(r.ph.seconds.values())
        ctx, policy = self.context, self.policy
        with r.ph("control"):
            if r.free:
                ctx.update(len(r.free), r.n_acc, round_s)
            else:
                if ctx is not None and r.g_max == 0:   # neither source drafted
                    ctx.plain_step(round_s)
                # a full-depth batch's cost teaches the prices (the context drafter times
                # its own rounds and the plain steps where it runs; an early-exit
                # verifier's batches are not the table's)
                rows, verify_s = 0, 0.0
                if r.draft and self.verifier is None:
                    rows, verify_s = len(r.draft) + 1, r.ph.seconds["verify"]
                elif not r.draft and ctx is None:
                    rows, verify_s = 1, r.ph.seconds["decode"]
                # the draft model's part of a round that ended in the prediction: its
                # tokens, and the round's seconds less the prediction rows' share
                k = len(r.draft) - r.tail
                if r.tail:
                    if r.n_acc >= k:
                        ctx.rejoined(r.tail, r.n_acc - k)
                    round_s -= verify_s * r.tail / rows
                policy.update(Outcome(k, min(r.n_acc, k), [c[0] for c in r.conf],
                                      [c[1] for c in r.conf], round_s, tried=r.g_max > 0,
                                      catch_up=r.ph.seconds.get("catch_up", 0.0),
                                      behind=r.behind,
                                      verify_rows=rows, verify_s=verify_s))
            if ctx is not None:
                ctx.extend(r.draft[:r.n_acc] + [r.nxt], emitted=True)


def generate_spec(tgt: Sequence, dft: Sequence | None, prompt: list[int],
                  policy: DraftPolicy | int, sampling: SamplingConfig,
                  trace: Callable[[dict], None] | None = None,
                  context: ContextSource | None = None,
                  verifier: Verifier | None = None, max_new: int | None = None,
                  is_eog: Callable[[int], bool] | None = None) -> Iterator[Step]:
    """Speculative decoding: each round plans, drafts, verifies and learns (`SpecLoop`).

    ``policy`` says how many tokens the draft model drafts each round (an int: a fixed
    gamma); ``context``, if given, is a free drafter from the context that takes a round
    whenever it is predicted to beat both plain decoding and the policy's best round;
    ``verifier`` (greedy only) scores the draft model's rounds instead of a full-depth
    decode; ``max_new`` is the most tokens the caller will take (no round drafts past it);
    ``is_eog`` ends a model draft at an end-of-generation token. ``trace`` receives one
    record per round the draft model drafted: the profiling data of a draft-length
    controller."""
    policy = FixedGamma(policy) if isinstance(policy, int) else policy
    loop = SpecLoop(tgt, dft, policy, sampling, context, verifier, max_new, is_eog,
                    confidence=trace is not None)
    t0 = time.perf_counter()
    token = loop.start(prompt)
    yield Step(token=token, timings={"prefill": time.perf_counter() - t0})
    n_out = 1
    while True:
        r = loop.plan(n_out)
        loop.draft(r, token)
        loop.verify(r, token)
        loop.learn(r)
        if trace is not None and r.draft and not r.free:
            k = len(r.draft) - r.tail   # the draft model's tokens
            trace({"gamma": k, "draft_top1": [round(c[0], 5) for c in r.conf],
                   "draft_entropy": [round(c[1], 5) for c in r.conf],
                   "n_accept": min(r.n_acc, k), "t_draft": r.ph.seconds["draft"],
                   "t_verify": r.ph.seconds["verify"]})
        n_out += r.n_acc + 1
        for tok in r.draft[:r.n_acc]:
            yield Step(token=tok, exit_layer=r.exit_layer, drafted=True)
        yield Step(token=r.nxt, exit_layer=r.exit_layer, n_drafted=len(r.draft),
                   n_accept=r.n_acc, source=r.source,
                   timings=r.timings())
        token = r.nxt

"""Draft-then-verify speculative decoding with a fixed draft length gamma.

Each round the draft proposes gamma tokens after the last emitted one, the target scores
all of them in one batch, the longest acceptable prefix is kept plus one token from the
target, and both KV caches are cut back to what was emitted. Greedy decoding is lossless
(up to the target's batched arithmetic, see tests); sampling uses the standard rejection
rule, so the output distribution is the target's.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np

from ..config import SamplingConfig
from .sampling import probs
from .sequence import Sequence
from .steps import Step


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


def draft_confidence(logits: np.ndarray) -> tuple[float, float]:
    """(top-1 probability, entropy in nats) of the draft's full softmax."""
    z = logits.astype(np.float64) - logits.max()
    p = np.exp(z)
    p /= p.sum()
    nz = p[p > 0]
    return float(p.max()), float(-(nz * np.log(nz)).sum())


def generate_spec(tgt: Sequence, dft: Sequence, prompt: list[int], gamma: int,
                  sampling: SamplingConfig,
                  trace: Callable[[dict], None] | None = None) -> Iterator[Step]:
    """Speculative decoding with draft length gamma. ``trace``, if given, receives one record
    per round (the draft's top-1 probability and entropy per drafted token, the accepted
    count, draft and verify seconds): the profiling data of a draft-length controller."""
    clock = time.perf_counter
    rng = np.random.default_rng(sampling.seed)
    greedy = sampling.greedy

    def pick(dist: np.ndarray) -> int:
        return int(np.argmax(dist)) if greedy else int(rng.choice(len(dist), p=dist))

    t0 = clock()
    first = probs(tgt.prefill(prompt), sampling)
    dft.prefill(prompt)
    token = pick(first)
    yield Step(token=token, timings={"prefill": clock() - t0})
    pending = [token]  # emitted tokens the draft has not seen yet
    while True:
        base_t = len(tgt.tokens)
        t0 = clock()
        draft, q, conf = [], [], []
        lg = dft.feed(pending)
        for i in range(gamma):
            if trace is not None:
                conf.append(draft_confidence(lg))
            dist = probs(lg, sampling)
            draft.append(pick(dist))
            q.append(dist)
            if i < gamma - 1:
                lg = dft.feed([draft[-1]])
        t1 = clock()
        logits = tgt.feed([token] + draft, all_logits=True)
        p = np.stack([probs(row, sampling) for row in logits])
        n_acc, nxt = accept_drafts(draft, q, p, rng, greedy)
        # keep what was emitted: the target holds token + accepted drafts, the draft too
        tgt.rewind(base_t + 1 + n_acc)
        dft.rewind(min(len(dft.tokens), base_t + 1 + n_acc))
        pending = draft[len(dft.tokens) - base_t - 1:n_acc] + [nxt]
        t2 = clock()
        if trace is not None:
            trace({"gamma": gamma, "draft_top1": [c[0] for c in conf],
                   "draft_entropy": [c[1] for c in conf], "n_accept": n_acc,
                   "t_draft": t1 - t0, "t_verify": t2 - t1})
        for tok in draft[:n_acc]:
            yield Step(token=tok, source="draft")
        yield Step(token=nxt, n_drafted=gamma, n_accept=n_acc,
                   timings={"draft": t1 - t0, "verify": t2 - t1})
        token = nxt

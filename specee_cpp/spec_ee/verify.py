"""Hyper-token exit: SpecEE's early exit inside speculative verification.

A round's verify batch (the last emitted token and the drafted ones) is one staged decode.
At each scheduled layer every row is probed with its own candidates, the draft's top-k at
that position (the draft computed those logits while drafting; the last drafted token's
take one more draft step), and the layer's predictor scores each row. The batch exits
together, its skipped layers' K/V filled from the exit state, when every row that decides
the round is settled: each row up to and including the first whose exit token rejects the
next drafted token (the rows after it are discarded by the acceptance rule whatever they
say), or every row when all drafts are kept. A row whose probe does not fire, or (SpecEE's
argmax rule) whose layer argmax is not one of its candidates, keeps the batch going; with
no exit the batch finishes at full depth, exactly as ``--mode spec`` verifies.
"""
from __future__ import annotations

import numpy as np

from ..config import LOOP_REPEATS, LOOP_SPAN
from ..early_exit.candidates import top_k
from ..early_exit.features import features
from ..early_exit.predictor import Predictors
from ..early_exit.scheduler import Scheduler
from ..engine.sequence import Sequence


def looping(tokens: list[int], span: int = LOOP_SPAN, repeats: int = LOOP_REPEATS) -> bool:
    """Whether the output ends in a block of 1..``span`` tokens repeated ``repeats`` times:
    a batch's exits that feed their tokens back as the next round's drafts can lock into
    such a loop, so these rounds are verified at full depth (which leaves a loop the model
    means)."""
    for n in range(1, span + 1):
        if len(tokens) < n * repeats:
            break
        block = tokens[-n:]
        if all(tokens[-(i + 1) * n:len(tokens) - i * n] == block for i in range(1, repeats)):
            return True
    return False


def decisive(settled: list[bool], exits: list[int], tokens: list[int]) -> bool:
    """Whether the rows that decide a round are all settled at this layer. Row i's exit
    token ``exits[i]`` is checked against the next drafted token ``tokens[i + 1]``; the first
    row that rejects it ends the round, so the rows after it do not matter."""
    for i, ok in enumerate(settled):
        if not ok:
            return False
        if i + 1 < len(tokens) and exits[i] != tokens[i + 1]:
            return True
    return True


class HyperVerifier:
    """The ``verifier`` of ``speculative.decode.generate_spec`` for mode spec-ee (one per
    generation: the scheduler keeps the recent exit layers)."""

    def __init__(self, predictors: Predictors, scheduler: Scheduler,
                 thresholds: dict[int, float], rule: str = "argmax"):
        self.pred, self.sched, self.thresholds, self.rule = predictors, scheduler, thresholds, rule

    def __call__(self, tgt: Sequence, tokens: list[int], rows: list[np.ndarray],
                 dft: Sequence):
        ctx, n, k = tgt.ctx, len(tokens), self.pred.k
        recent = tgt.tokens[-LOOP_SPAN * LOOP_REPEATS:] + tokens[:1]
        # a looping output is verified at full depth (exits can lock into one: looping)
        layers = [] if looping(recent) else self.sched.layers(n_rows=n)
        if not layers:   # nothing worth probing: spec's own one-batch verification
            tgt.decode(tokens, all_outputs=True)
            self.sched.record(None)
            return tgt.argmax, None
        if len(rows) < n:   # the last drafted token's candidates: one more draft step
            dft.decode(tokens[-1:])
            rows.append(dft.logits())
        cand = np.stack([top_k(r, k) for r in rows[:n]])
        exit_layer, exits, finished, prev = None, None, False, None
        tgt.begin_staged(tokens, all_logits=True)
        try:
            for layer in layers:
                probe = ctx.stage_run(layer, cand)
                x, prev = features(probe, prev, k)
                fire = self.pred.prob(layer, x) > self.thresholds[layer]
                if not fire[0]:
                    continue
                if self.rule == "candidate":
                    exits = [int(c[j]) for c, j in zip(cand, np.argmax(probe, axis=1))]
                    settled = list(fire)
                else:
                    ctx.stage_head()
                    exits = [ctx.argmax(i) for i in range(n)]
                    settled = [bool(f) and e in c for f, e, c in zip(fire, exits, cand)]
                if decisive(settled, exits, tokens):
                    ctx.stage_exit(full_head=False)
                    finished, exit_layer = True, layer
                    break
            if exit_layer is None:
                ctx.stage_run(ctx.model.n_layer)
                finished = True
        except BaseException:
            if not finished:
                tgt.abort_staged(n)  # the cache must not keep a half-decoded batch
            raise
        self.sched.record(exit_layer)
        if exit_layer is None:
            return tgt.argmax, None
        return exits.__getitem__, exit_layer

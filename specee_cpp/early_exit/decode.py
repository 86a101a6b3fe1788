"""Early-exit decoding (SpecEE) on the staged-decode patch.

Per token: the provider proposes candidates; the target runs layer segments up to each
scheduled layer, where the candidates' logits are probed and the layer's predictor scores
them. When it fires, SpecEE's rule checks that the layer's full-vocabulary argmax is one of
the candidates (a head computed at that layer, stage kept open); if so the token exits there
and the skipped layers' K/V are filled from the exit state, otherwise the target goes on.
The faster ``candidate`` rule skips that head and emits the top probed candidate.
Greedy only: early exit changes the distribution, so sampling is not offered here.
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ..config import LOOP_REPEATS, LOOP_SPAN
from ..engine.sequence import Sequence
from ..engine.steps import Step
from .candidates import CandidateProvider
from .costs import LearnedPlan
from .features import features
from .predictor import Predictors
from .scheduler import Scheduler



def looping(tokens: list[int], span: int = LOOP_SPAN, repeats: int = LOOP_REPEATS) -> bool:
    """Whether the output ends in a block of 1..``span`` tokens repeated ``repeats`` times:
    early exits that feed their own tokens back as candidates can lock into such a loop,
    so these tokens are decoded at full depth (which leaves a loop the model means)."""
    for n in range(1, span + 1):
        if len(tokens) < n * repeats:
            break
        block = tokens[-n:]
        if all(tokens[-(i + 1) * n:len(tokens) - i * n] == block for i in range(1, repeats)):
            return True
    return False


def generate_ee(seq: Sequence, prompt: list[int], provider: CandidateProvider,
                predictors: Predictors, scheduler: Scheduler, thresholds: dict[int, float],
                rule: str = "argmax", plan: LearnedPlan | None = None) -> Iterator[Step]:
    """``thresholds``: the firing threshold of each layer that may be probed (early_exit/mode.py's
    exit_plan: from the quality target, or one for all). ``plan``: the layers worth probing
    on this machine's costs, learned as the answer goes (early_exit/costs.py), probed in
    place of the scheduler's; while it holds none, tokens are decoded plainly, without
    candidates (None: the layers the scheduler lists)."""
    ctx = seq.ctx
    n_layer = ctx.model.n_layer
    k = predictors.k
    clock = time.perf_counter

    t0 = clock()
    logits = seq.prefill(prompt)
    provider.reset(prompt)
    token, exit_layer = int(np.argmax(logits)), None
    timings = {"prefill": clock() - t0}
    out: list[int] = []
    while True:
        yield Step(token=token, exit_layer=exit_layer, timings=timings)
        out.append(token)
        t0 = clock()
        provider.accept(token, exited=exit_layer is not None)
        # the plan's layers where it holds (chosen by what they cost and save here), else
        # SpecEE's schedule; none while the output loops
        layers = [] if looping(out[-LOOP_SPAN * LOOP_REPEATS:]) else \
            plan.chosen if plan is not None else scheduler.layers()
        # candidates only for a token that will be probed: the draft provider catches up on
        # the tokens in between in one batch when next asked
        cand = provider.propose() if layers else ()
        t_draft = clock() - t0
        if not len(cand):
            # nothing to probe: a plain decode
            seq.decode([token])
            token, exit_layer = seq.argmax(), None
            timings = {"decode": clock() - t0}
            continue
        t_layers = t_probe = t_head = 0.0
        exit_layer, nxt, prev, finished = None, -1, None, False
        probed: list[int] = []
        seq.begin_staged([token])
        try:
            for layer in layers:
                probed.append(layer)
                t0 = clock()
                probe = ctx.stage_run(layer, cand[None, :])[0]
                t1 = clock()
                x, prev = features(probe, prev, k)
                fire = predictors.prob(layer, x) > thresholds[layer]
                t2 = clock()
                t_layers += t1 - t0
                t_probe += t2 - t1
                if not fire:
                    continue
                if rule == "candidate":
                    nxt = int(cand[int(np.argmax(probe))])
                else:
                    ctx.stage_head()
                    nxt = int(np.argmax(ctx.logits(-1)))
                    if nxt not in cand:  # the layer is not settled on a candidate: go on
                        t_head += clock() - t2
                        continue
                ctx.stage_exit(full_head=False)
                finished = True
                t_head += clock() - t2
                exit_layer = layer
                break
            if exit_layer is None:
                t0 = clock()
                ctx.stage_run(n_layer)
                finished = True
                nxt = int(np.argmax(ctx.logits(-1)))
                t_layers += clock() - t0
        except BaseException:
            if not finished:
                seq.abort_staged(1)  # the cache must not keep a half-decoded token
            raise
        scheduler.record(exit_layer)
        if plan is not None:
            plan.record(probed, exit_layer)
        token = nxt
        timings = {"draft": t_draft, "layers": t_layers, "probe": t_probe, "head": t_head}

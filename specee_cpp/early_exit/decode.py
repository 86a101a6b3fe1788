"""Early-exit decoding (SpecEE) on the staged-decode patch, with every exit checked.

Per token: the provider proposes candidates; the target runs layer segments up to each
scheduled layer, where the candidates' logits are probed and the layer's predictor scores
them. When it fires, SpecEE's rule checks that the layer's full-vocabulary argmax is one of
the candidates (a head computed at that layer, stage kept open); if so the token exits there,
otherwise the target goes on. The faster ``candidate`` rule skips that head and emits the
top probed candidate.

An exit leaves the exited token's K/V of the skipped layers approximated (filled from the
exit state), and every later token attends to them: left there, tokens decoded at full depth
after an exit disagreed with plain decoding three times as often as before it. So the exit
is checked before it is emitted: the next step decodes the exited position again at full
depth together with the token it chose (two rows, about one token's cost with the
small-batch kernels). The first row's output is full depth's choice there: the same token
confirms the exit and the second row gives the next one; another token replaces it and the
chosen one is dropped. Output is plain greedy decoding's, token for token; an exit's
quality target only sets how often that check undoes one. Greedy only.

Given the caller's predicted output (OpenAI's ``prediction``), a step where the output
follows it verifies the prediction's draft at full depth in one batch instead, as the
speculative loop does; the steps between its drafts probe and exit as above.
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ..engine.drafts import accept_greedy, draft_room
from ..engine.predicted import PredictionDrafter
from ..engine.sequence import Sequence
from ..engine.steps import Step
from .candidates import CandidateProvider
from .costs import LearnedPlan
from .features import features
from .predictor import Predictors
from .scheduler import Scheduler


def generate_ee(seq: Sequence, prompt: list[int], provider: CandidateProvider,
                predictors: Predictors, scheduler: Scheduler, thresholds: dict[int, float],
                rule: str = "argmax", plan: LearnedPlan | None = None,
                drafts: PredictionDrafter | None = None,
                max_new: int | None = None) -> Iterator[Step]:
    """``thresholds``: the firing threshold of each layer that may be probed (early_exit/mode.py's
    exit_plan: from the quality target, or one for all). ``plan``: the layers worth probing
    on this machine's costs, learned as the answer goes (early_exit/costs.py), probed in
    place of the scheduler's; while it holds none, tokens are decoded plainly, without
    candidates (None: the layers the scheduler lists). An exited token's step says how its
    check went (``n_drafted`` 1, ``n_accept`` 1 if confirmed, ``source`` "exit").
    ``drafts``: the caller's prediction (engine/predicted.py); where it plans a draft, the
    step verifies it at full depth in one batch instead, as the speculative loop does, within
    ``max_new`` tokens in all."""
    clock = time.perf_counter
    t0 = clock()
    logits = seq.prefill(prompt)
    provider.reset(prompt)
    token = int(np.argmax(logits))
    if drafts is not None:
        drafts.extend(prompt + [token])
        drafts.output_began(token)
    step, n_out = Step(token=token, timings={"prefill": clock() - t0}), 0
    while True:
        yield step
        token, n_out = step.token, n_out + 1
        provider.accept(token)
        t0 = clock()
        free = drafts.plan(len(seq.tokens) + 1, draft_room(max_new, n_out)) \
            if drafts is not None else []
        if free:   # the prediction's draft, verified as the speculative loop verifies one
            source, base = drafts.source, len(seq.tokens)
            seq.decode([token] + free, all_outputs=True)
            n_acc, nxt = accept_greedy(free, seq.argmax)
            seq.rewind(base + 1 + n_acc)
            seconds = clock() - t0
            drafts.update(len(free), n_acc, seconds)
            drafts.extend(free[:n_acc] + [nxt], emitted=True)
            for tok in free[:n_acc]:
                yield Step(token=tok, drafted=True)
                provider.accept(tok)
            n_out += n_acc
            step = Step(token=nxt, n_drafted=len(free), n_accept=n_acc, source=source,
                        timings={"verify": seconds})
            continue
        # the plan's layers where it holds (chosen by what they cost and save here), else
        # SpecEE's schedule; candidates only for a token that will be probed (the draft
        # provider catches up on the tokens in between in one batch when next asked)
        layers = plan.chosen if plan is not None else scheduler.layers()
        cand = provider.propose() if layers else ()
        t_draft = clock() - t0
        if not len(cand):   # nothing to probe: a plain decode
            seq.decode([token])
            nxt = seq.argmax()
            seconds = clock() - t0
            step = Step(token=nxt, timings={"decode": seconds})
            if drafts is not None:
                drafts.plain_step(seconds)
                drafts.extend([step.token], emitted=True)
            continue
        nxt, exit_layer, probed, timings = _probed(seq, token, cand, layers, predictors,
                                                   thresholds, rule)
        timings["draft"] = t_draft
        checked = None
        if exit_layer is not None:
            # the exited position again at full depth, with the token it chose
            t0 = clock()
            seq.rewind(len(seq.tokens) - 1)
            seq.decode([token, nxt], all_outputs=True)
            full = seq.argmax(0)
            checked = full == nxt
            timings["check"] = clock() - t0
            if not checked:   # full depth chose another token: it replaces the exit's
                seq.rewind(len(seq.tokens) - 1)
                nxt, exit_layer = full, None
        scheduler.record(exit_layer)
        if plan is not None:
            plan.record(probed, exit_layer)
        if checked:
            if drafts is not None:
                drafts.extend([nxt], emitted=True)
            yield Step(token=nxt, exit_layer=exit_layer, timings=timings, n_drafted=1,
                       n_accept=1, source="exit")
            provider.accept(nxt)
            n_out += 1
            # the check's second row is full depth's next token: no decode left for it
            step = Step(token=seq.argmax(1), timings={})
        else:
            step = Step(token=nxt, exit_layer=exit_layer, timings=timings,
                        n_drafted=int(checked is not None), n_accept=0,
                        source="exit" if checked is not None else None)
        if drafts is not None:
            drafts.extend([step.token], emitted=True)


def _probed(seq: Sequence, token: int, cand: np.ndarray, layers: list[int],
            predictors: Predictors, thresholds: dict[int, float], rule: str):
    """Decode ``token`` staged, probing ``cand`` at ``layers``: (next token, the layer it
    exited at or None for full depth, the layers probed, seconds by phase)."""
    ctx, clock = seq.ctx, time.perf_counter
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
            x, prev = features(probe, prev, predictors.k)
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
            ctx.stage_run(ctx.model.n_layer)
            finished = True
            nxt = int(np.argmax(ctx.logits(-1)))
            t_layers += clock() - t0
    except BaseException:
        if not finished:
            seq.abort_staged(1)  # the cache must not keep a half-decoded token
        raise
    return nxt, exit_layer, probed, {"layers": t_layers, "probe": t_probe, "head": t_head}

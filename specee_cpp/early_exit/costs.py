"""What early exit costs and saves on this machine, and which layers are worth probing.

An exit pays only where the layers it skips outweigh what finding it costs: the candidates
(a draft decode per token with the draft provider, next to nothing with n-grams), a probe
at each scheduled layer (a segment boundary, the candidates' logits, the predictor), the
full head a firing layer computes for SpecEE's argmax check, the check of every exit (the
exited position decoded again with its token: two rows where the next token had one), and
what a staged decode costs over ``llama_decode``. On a 2-core CPU the draft's token alone
costs about two thirds of a target token and a check about another, more than exits in the
last quarter of the layers can save; where a two-row batch costs little more than one row
it may pay. So the prices are measured here (seconds, once per target, draft and machine,
cached with the cost tables), and a run probes only the layers whose expected saving
exceeds their cost at the exit rates seen (the calibration's, then this answer's); with
none, it decodes plainly.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..config import COST_PROMPT, EE_COST_CONTEXT, EE_COST_REPEATS

VERSION = 2   # part of the cache key: a changed method measures again


@dataclass(frozen=True)
class ExitCosts:
    plain_s: float       # one token by llama_decode, greedy token read in C
    staged_s: float      # the same token staged: one segment to the end, logits read
    probe_s: float       # one more segment boundary with the candidates' logits + predictor
    head_s: float        # the full head at a layer (SpecEE's argmax check)
    exit_lo_s: float     # a token exiting at layer ``lo`` (candidate rule: no head)
    exit_hi_s: float     # ... at layer ``hi``
    lo: int
    hi: int
    draft_s: float       # one draft decode, its logits read (the draft provider's candidates)
    n_layer: int
    check_s: float       # two tokens by llama_decode, both greedy tokens read (an exit's check)

    def exit_s(self, layer: int, rule: str) -> float:
        """Seconds of a token that exits at ``layer`` (layers up to it, the exit's K/V fill,
        SpecEE's head where ``rule`` is argmax; the exits timed at two layers, read linearly
        between them), and of its check: two rows in place of the next token's one."""
        w = (layer - self.lo) / max(self.hi - self.lo, 1)
        t = self.exit_lo_s + w * (self.exit_hi_s - self.exit_lo_s)
        return (t + (self.head_s if rule == "argmax" else 0.0)
                + max(self.check_s - self.plain_s, 0.0))

    def token_s(self, layers: list[int], rates: dict[int, float], rule: str,
                candidates_s: float) -> float:
        """Expected seconds of a token probed at ``layers`` (ascending), each exiting a token
        that reaches it with probability ``rates[l]``; the rest run to the end staged. A
        firing layer's head is counted for its exits only (those that fire and are refused
        cost it too: not counted, so this is a lower bound there). No layers: plain decoding."""
        if not layers:
            return self.plain_s
        t, reach = candidates_s, 1.0
        for l in layers:
            t += reach * self.probe_s
            p = reach * min(max(rates.get(l, 0.0), 0.0), 1.0)
            t += p * self.exit_s(l, rule)
            reach -= p
        return t + reach * self.staged_s

    def best_layers(self, layers: list[int], rates: dict[int, float], rule: str,
                    candidates_s: float) -> tuple[list[int], float]:
        """The subset of ``layers`` with the least expected token time (greedy: drop the
        layer whose removal saves most while one does) and that time. It may be slower than
        plain decoding (``plain_s``): the candidates are paid once a token whichever layers
        are probed, so dropping layers one by one never sees them go; the caller compares."""
        keep = sorted(layers)
        best = self.token_s(keep, rates, rule, candidates_s)
        while len(keep) > 1:
            trials = [(self.token_s(keep[:i] + keep[i + 1:], rates, rule, candidates_s), i)
                      for i in range(len(keep))]
            t, i = min(trials)
            if t >= best:
                break
            best = t
            keep = keep[:i] + keep[i + 1:]
        return keep, best

    def describe(self, draft: bool = True) -> str:
        p = self.plain_s
        return ((f"a draft token {self.draft_s / p:.2f}, " if draft else "")
                + f"a probe {self.probe_s / p:.3f}, a "
                f"head {self.head_s / p:.2f}, a staged token {self.staged_s / p:.3f} of a plain "
                f"token ({1e3 * p:.1f} ms); a token exiting at layer {self.hi} of "
                f"{self.n_layer} {self.exit_hi_s / p:.2f}, its check "
                f"{(self.check_s - p) / p:.2f} more")


def _key(llm) -> str:
    from ..provenance import machine, machine_id

    where = machine(llm.config.threads)
    draft = llm.draft_sha256()[:12] if llm.draft_path is not None else "none"
    return f"exit-{llm.model.sha256[:12]}-{draft}-m{machine_id(where)}-v{VERSION}"


def exit_costs(llm, pred) -> ExitCosts:
    """This machine's ExitCosts for the loaded target (and draft), measured on first use
    (a few seconds), then cached under ``$SPECEE_CPP_HOME/costs``; exits are timed at the
    lowest and highest of the predictors ``pred``'s layers."""
    layers = pred.layers
    from ..paths import home, write_text_atomic

    def make():
        path = home() / "costs" / f"{_key(llm)}.json"   # beside the speculative cost tables
        try:
            c = ExitCosts(**json.loads(path.read_text(encoding="utf-8")))
            if (c.lo, c.hi, c.n_layer) == (min(layers), max(layers), llm.model.n_layer):
                return c
        except (OSError, ValueError, TypeError):
            pass
        c = measure(llm, pred)
        write_text_atomic(path, json.dumps(asdict(c)))
        return c

    return llm.cached(("ee", "costs", min(layers), max(layers)), make)


def measure(llm, pred, repeats: int = EE_COST_REPEATS, clock=time.perf_counter) -> ExitCosts:
    """Time each part of an early-exit token against plain ones, interleaved round by round
    (a machine slowing down slows all alike), medians of ``repeats`` after a warm-up; the
    caches are left empty. A staged token that fails half-way is undone by the caller's error
    path: none here."""
    from ..engine.timing import time_calls
    from .features import features

    seq, ctx = llm.tgt.seq, llm.tgt.ctx
    n_layer, k = llm.model.n_layer, pred.k
    lo, hi = min(pred.layers), max(pred.layers)
    mid = sorted(pred.layers)[len(pred.layers) // 2]
    tokens = llm.prompt_tokens(COST_PROMPT)
    context = (tokens * (EE_COST_CONTEXT // len(tokens) + 1))[:EE_COST_CONTEXT]
    seq.prefill(context, read=False)
    base = len(seq.tokens)
    cand = np.array([context[-k:]], dtype=np.int32)

    def plain():
        seq.decode([context[0]])
        seq.argmax()

    def staged():
        seq.begin_staged([context[0]])
        ctx.stage_run(n_layer)
        int(np.argmax(ctx.logits(-1)))

    def probed():
        seq.begin_staged([context[0]])
        x, _ = features(ctx.stage_run(mid, cand)[0], None, k)
        pred.prob(mid, x)
        ctx.stage_run(n_layer)
        int(np.argmax(ctx.logits(-1)))

    def headed():
        seq.begin_staged([context[0]])
        ctx.stage_run(mid, cand)
        ctx.stage_head()
        int(np.argmax(ctx.logits(-1)))
        ctx.stage_run(n_layer)
        int(np.argmax(ctx.logits(-1)))

    def exiting(layer):
        def run():
            seq.begin_staged([context[0]])
            ctx.stage_run(layer, cand)
            ctx.stage_exit(full_head=False)
        return run

    def check():
        seq.decode(context[:2], all_outputs=True)
        seq.argmax(0)
        seq.argmax(1)

    def undo():
        seq.rewind(base)

    calls = {name: (run, undo) for name, run in
             (("plain", plain), ("staged", staged), ("probed", probed), ("headed", headed),
              ("exit_lo", exiting(lo)), ("exit_hi", exiting(hi)), ("check", check))}
    if llm.draft_path is not None:
        dft = llm.dft.seq
        dft.prefill(context, read=False)
        d_base = len(dft.tokens)
        calls["draft"] = (lambda: dft.feed([context[0]]), lambda: dft.rewind(d_base))
    med = time_calls(calls, repeats, warmup=1, clock=clock)
    # emptied, not kept for the next prefill: the cost context shares the chat template's
    # first tokens with a prompt, and cells read in its batch round otherwise than a fresh
    # read of the prompt, so a near tie in the first answer would go by the measurement
    llm.reset()
    return ExitCosts(plain_s=med["plain"], staged_s=med["staged"],
                     probe_s=max(med["probed"] - med["staged"], 0.0),
                     head_s=max(med["headed"] - med["probed"], 0.0),
                     exit_lo_s=med["exit_lo"], exit_hi_s=med["exit_hi"], lo=lo, hi=hi,
                     draft_s=med.get("draft", 0.0), n_layer=n_layer, check_s=med["check"])


class LearnedPlan:
    """The layers worth probing for one answer: chosen from this machine's ``costs`` and
    each layer's exit rate (the calibration's at first, counted as ``prior`` probes, then
    what this answer's probes saw), again every ``every`` tokens. A layer left out is not
    probed and learns nothing, so an answer whose exits stopped paying decodes plainly for
    the rest of it (``chosen`` empty)."""

    def __init__(self, costs: ExitCosts, rates: dict[int, float], rule: str,
                 candidates_s: float, prior: float | None = None, every: int | None = None):
        from ..config import EE_RATE_PRIOR, EE_REPLAN

        self.costs, self.rule, self.candidates_s = costs, rule, candidates_s
        self.prior_rates = dict(rates)
        self.prior = EE_RATE_PRIOR if prior is None else prior
        self.every = EE_REPLAN if every is None else every
        self.probes = {l: 0 for l in rates}
        self.exits = {l: 0 for l in rates}
        self.n = 0
        self._choose(rates)

    def _choose(self, rates: dict[int, float]) -> None:
        layers, self.probing_s = self.costs.best_layers(list(self.prior_rates), rates,
                                                        self.rule, self.candidates_s)
        self.chosen = layers if self.probing_s < self.costs.plain_s else []

    def rates(self) -> dict[int, float]:
        return {l: (self.exits[l] + self.prior * r) / (self.probes[l] + self.prior)
                for l, r in self.prior_rates.items()}

    def probing_speed(self) -> float:
        """Predicted speed over plain decoding of the best layers to probe (below 1: none
        pays)."""
        return self.costs.plain_s / self.probing_s

    def speed(self) -> float:
        """Predicted speed over plain decoding of the plan now (1: it probes nothing)."""
        return max(self.probing_speed(), 1.0) if self.chosen else 1.0

    def record(self, probed: list[int], exit_layer: int | None) -> None:
        """A token was probed at ``probed`` (in order) and exited at ``exit_layer`` (None:
        ran to the end)."""
        for l in probed:
            if l in self.probes:
                self.probes[l] += 1
                self.exits[l] += l == exit_layer
        self.n += 1
        if self.n % self.every == 0:
            self._choose(self.rates())

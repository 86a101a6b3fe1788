"""Mode ``ee``: SpecEE early exit. Its options, and what it derives once per loaded target
(kept with ``LLM.cached``): the exit predictor bundle, checked against the target."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import MAX_EXIT_ERROR, N_CAND
from ..engine.modes import Mode, register
from ..errors import SpeceeError
from ..paths import BUNDLE_DIR
from .costs import LearnedPlan, exit_costs


@dataclass(frozen=True)
class EEOptions:
    """Early exit (SpecEE) settings; ``None`` fields come from the predictor bundle."""

    # draft | ngram; None: the one predicted fastest on this machine's costs (the draft's
    # top-k only where a draft model is loaded)
    provider: str | None = None
    predictors: Path | None = None    # bundle path; None: the one shipped for the target
    threshold: float | None = None    # one threshold for every layer (overrides the target)
    rule: str = "argmax"              # argmax (SpecEE) | candidate (skips the head check)
    k: int = N_CAND
    # exits choose another token than full depth at most this often (the bundle's plan for
    # it: per-layer thresholds, early_exit/quality.py); ee's check undoes each such exit, so
    # the target sets how much time they waste, spec-ee's how much output they change
    max_exit_error: float = MAX_EXIT_ERROR
    # probe even where this machine's costs say exits cannot pay (to measure them); by
    # default such a run decodes plainly and says why
    always: bool = False

    def __post_init__(self) -> None:
        if self.provider not in (None, "draft", "ngram"):
            raise SpeceeError(f"unknown candidate provider {self.provider!r}; use draft or ngram")
        if self.rule not in ("argmax", "candidate"):
            raise SpeceeError(f"unknown exit rule {self.rule!r}; use argmax or candidate")
        if self.k < 1:
            raise SpeceeError(f"k must be positive, got {self.k}")
        # a probability threshold: 1.0 never fires (the rule is prob > threshold); NaN fails too
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise SpeceeError(f"threshold must be in [0, 1] (1 never exits), got {self.threshold}")
        if not 0.0 <= self.max_exit_error < 1.0:
            raise SpeceeError(f"max_exit_error must be in [0, 1), got {self.max_exit_error}")
        if self.predictors is not None:
            object.__setattr__(self, "predictors", Path(self.predictors))


def bundle_path(target_sha256: str, provider: str) -> Path:
    """Where the shipped (or default calibrated) exit predictors for a target live."""
    return BUNDLE_DIR / f"{target_sha256[:16]}.{provider}.npz"


def candidates(llm, provider: str, k: int = N_CAND):
    """A fresh candidate provider: ``draft`` (needs a draft model) or ``ngram``."""
    from .candidates import DraftCandidates, NgramCandidates

    if provider == "draft":
        if llm.draft_path is None:
            raise SpeceeError("the draft provider needs a draft model (--draft)")
        from ..engine.draft_attention import draft_attention

        draft_attention(llm)   # it decodes the draft on every token
        return DraftCandidates(llm.dft.seq, k=k)
    if provider == "ngram":
        return NgramCandidates(k=k)
    raise SpeceeError(f"unknown candidate provider {provider!r}; use draft or ngram")


def predictors(llm, opts: EEOptions):
    """The exit predictors for this target and provider (checked against the target)."""
    from .predictor import Predictors

    path = opts.predictors or bundle_path(llm.model.sha256, opts.provider)

    def make():
        if opts.predictors is None and not path.is_file():
            raise SpeceeError(
                f"no shipped exit predictors for {llm.model.path.name} with the "
                f"{opts.provider} provider; run specee-cpp calibrate and pass --predictors")
        pred = Predictors.load(path)
        pred.check_target(llm.model.sha256, llm.model.n_layer, llm.model.path)
        return pred

    pred = llm.cached(("ee", "predictors", path), make)
    if pred.k != opts.k:
        raise SpeceeError(f"predictor bundle {path.name} uses k={pred.k}, not k={opts.k}")
    if pred.meta.get("provider") != opts.provider:
        raise SpeceeError(f"predictor bundle was fitted with the {pred.meta.get('provider')} "
                          f"provider, not {opts.provider} (--provider {pred.meta.get('provider')})")
    return pred


def check_end_to_end(pred, opts: EEOptions, fitted: str) -> None:
    """Refuse a provider and rule whose exits, with the plan fitted for target ``fitted``,
    were measured above ``--max-exit-error`` on prompts the calibration did not see: the
    bundle's ``end_to_end`` record (written by scripts/exit_error.py) counts how often they
    disagreed with full depth there. Refused only when the whole interval is above."""
    m = pred.meta.get("end_to_end", {}).get(opts.rule, {}).get(fitted)
    if m and m["low"] > opts.max_exit_error:
        raise SpeceeError(
            f"the {opts.provider} provider's exits with the {opts.rule} rule were measured at "
            f"{m['error']:.1%} wrong ({m['low']:.1%}-{m['high']:.1%}, {m['exits']} exits on "
            f"{m['prompts']}), above --max-exit-error {opts.max_exit_error:g}; "
            f"use another --provider or --exit-rule, or add --unsafe-exits")


def exit_plan(pred, opts: EEOptions, refuse_unmeasured: bool = False
              ) -> tuple[dict[int, float], dict[int, float], list[int], str]:
    """(threshold per probed layer, exit rate per layer, offline schedule, note) for these
    options: the bundle's plan for the quality target (early_exit/quality.py), or one
    threshold for every layer when given (or when the bundle has no plans).

    ``refuse_unmeasured``: where exits change the output (spec-ee), refuse those whose error
    is unknown (no plans) or measured above the target (check_end_to_end); ee checks every
    exit, so there a wrong one costs time only."""
    from .quality import plan_for
    from .scheduler import offline_layers

    plans = pred.meta.get("exit_plans")
    rates = {int(k): v for k, v in pred.meta.get("exit_rate", {}).items()}
    offline = pred.meta.get("offline", pred.layers)
    if opts.threshold is None and not plans and refuse_unmeasured:
        raise SpeceeError(f"predictor bundle fitted on {pred.meta.get('created', '?')} has no "
                          f"exit plans, so its exits' error is unknown: fit it again with "
                          f"specee-cpp calibrate, or add --unsafe-exits")
    if opts.threshold is not None or not plans:
        t = pred.threshold if opts.threshold is None else opts.threshold
        note = f"threshold {t} at every layer" + ("" if plans else " (bundle without exit plans)")
        if t >= 1.0:   # never fires: no exit to expect
            rates = {l: 0.0 for l in pred.layers}
        return {l: t for l in pred.layers}, rates, offline, note
    thresholds, rates, fitted = plan_for(plans, opts.rule, opts.max_exit_error)
    if fitted is not None and refuse_unmeasured:
        check_end_to_end(pred, opts, fitted)
    offline = offline_layers(rates)
    if not thresholds:
        note = (f"no exits meet --max-exit-error {opts.max_exit_error:g} on the calibration's "
                f"held-out prompts with the {opts.rule} rule: every token at full depth")
    else:
        p = plans[opts.rule][fitted]
        note = (f"exits at {len(thresholds)} of {len(pred.layers)} layers, within "
                f"--max-exit-error {fitted} ({opts.rule} rule; on the calibration's held-out "
                f"prompts {p['wrong']} of {p['exits']} exits differed from full depth)")
    return thresholds, rates, offline, note


def plan(llm, pred, opts: EEOptions, costs=None, refuse_unmeasured: bool = False):
    """(threshold per probed layer, a fresh scheduler, note) for one generation: the exit
    plan of these options (``refuse_unmeasured`` as for exit_plan) and SpecEE's scheduler
    over the layers it allows, its per-layer cost check priced with ``costs`` (this
    machine's ExitCosts; None: none)."""
    from .scheduler import Scheduler

    thresholds, rates, offline, note = exit_plan(pred, opts, refuse_unmeasured)
    sched = Scheduler(n_layer=llm.model.n_layer, offline=offline,
                      allowed=set(thresholds), exit_rate=rates,
                      layer_cost=costs.staged_s / llm.model.n_layer if costs else 0.0,
                      probe_cost=costs.probe_s if costs else 0.0)
    return thresholds, sched, note


def candidates_cost(costs, provider: str) -> float:
    """Seconds a token's candidates cost: a draft decode, or (n-grams) a few dictionary
    lookups, nothing next to a decode."""
    return costs.draft_s if provider == "draft" else 0.0


def priced(llm, opts: EEOptions) -> tuple[EEOptions, Any, str]:
    """(options with the provider to run, the LearnedPlan of its best layers, why) where
    exits are predicted to pay on this machine by EE_MARGIN, else (opts, None, why): the
    providers worth trying (without ``opts.provider``: the draft's where a draft model is
    loaded, and the n-grams) each priced with this machine's costs at its calibration's
    exit rates, the fastest kept."""
    from ..config import EE_MARGIN

    if opts.provider == "draft" and llm.draft_path is None:
        raise SpeceeError("the draft provider needs a draft model (--draft)")
    names = [opts.provider] if opts.provider else (
        ["draft", "ngram"] if llm.draft_path is not None else ["ngram"])
    tried = []
    best = None
    for name in names:
        o = replace(opts, provider=name)
        try:
            pred = predictors(llm, o)
            thresholds, rates, _, _ = exit_plan(pred, o)
        except SpeceeError as e:
            if opts.provider or name == names[-1] and best is None:
                raise
            tried.append(f"no {name} candidates ({str(e).split('; ')[0]})")
            continue
        costs = exit_costs(llm, pred)
        lp = LearnedPlan(costs, {l: rates.get(l, 0.0) for l in thresholds}, o.rule,
                         candidates_cost(costs, name))
        tried.append(f"{lp.probing_speed():.2f}x plain with {name} candidates")
        if best is None or lp.probing_speed() > best[1].probing_speed():
            best = (o, lp, costs)
    o, lp, costs = best
    why = (f"early exit predicted at {', '.join(tried)} on this machine's costs "
           f"({costs.describe(draft='draft' in names)})")
    if lp.probing_speed() < 1.0 + EE_MARGIN:
        return opts, None, why
    return o, lp, why


def describe_target(opts) -> str:
    """A benchmark table's words for the exit setting of ``opts`` (ee's or spec-ee's)."""
    return (f"threshold {opts.threshold}" if opts.threshold is not None
            else f"max-exit-error {opts.max_exit_error}")


class EarlyExit(Mode):
    name = "ee"
    Options = EEOptions
    greedy_only = True
    takes_prediction = True   # its drafts verified at full depth between the exit steps
    help = "SpecEE early exit, every exit checked at full depth (greedy; output = plain)"

    def start(self, llm, sampling, opts):
        from .decode import generate_ee

        from ..engine.plain import PLAIN
        from ..engine.predicted import prediction_drafter
        from ..engine.steps import with_note

        chosen, learned, why = priced(llm, opts)
        if learned is None and not opts.always:
            # no layer pays here: plain decoding. The draft stays loaded: freeing it right
            # before a decode slowed that decode on a 2-core machine (its memory reclaimed on
            # the same cores), and the server's next request may draft with it
            start = PLAIN.start(llm, sampling, PLAIN.Options())
            note = (f"plain decoding: {why}; no layer's exits pay for their probes "
                    f"(--probe-always probes anyway)")
            return lambda tokens, max_new, prediction=None: with_note(
                start(tokens, max_new, prediction=prediction), note)
        if opts.provider is None:
            opts = chosen if learned is not None else replace(
                opts, provider="draft" if llm.draft_path is not None else "ngram")
        provider = candidates(llm, opts.provider, opts.k)
        pred = predictors(llm, opts)

        def run(tokens, max_new, prediction=None):
            thresholds, sched, note = plan(llm, pred, opts)
            lp = None
            if not opts.always:   # a plan of its own each answer: rates learned per answer
                lp = LearnedPlan(learned.costs, learned.prior_rates, opts.rule,
                                 learned.candidates_s)
                note += f"; {opts.provider} candidates, {why}"
            drafts = None
            if prediction:
                drafts = prediction_drafter(llm, prediction, sampling)
                note += "; drafts from the prediction verified at full depth"
            return with_note(generate_ee(llm.tgt.seq, tokens, provider, pred, sched,
                                         thresholds, rule=opts.rule, plan=lp, drafts=drafts,
                                         max_new=max_new), note)

        return run

    def describe(self, opts) -> str:
        return (f"specee-cpp --mode ee {opts.provider or 'auto'} {opts.rule} "
                f"{describe_target(opts)}" + (" --probe-always" if opts.always else ""))


register(EarlyExit())

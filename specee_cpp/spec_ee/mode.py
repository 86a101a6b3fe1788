"""Mode ``spec-ee``: draft then verify, each verify batch allowed to exit early together
(SpecEE's hyper-token). A mode of its own rather than an option of ``spec``: ``spec`` is
lossless and says so to the benchmark and the tests, this one is lossy through its exits.

It takes the draft's exit predictors (the candidates are the draft's top-k, as with
``--mode ee --provider draft``) and their quality target, and the draft length of ``spec``.
Drafting only from the draft model: a free draft from the context has no draft logits to
probe with.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import MAX_EXIT_ERROR, N_CAND
from ..early_exit.mode import EEOptions, describe_target
from ..engine.modes import Mode, no_status, register
from ..errors import SpeceeError
from ..speculative.mode import Gamma, SpecOptions


@dataclass(frozen=True)
class SpecEEOptions:
    # tokens drafted per round, or a policy; a fixed length by default, because the cost
    # model behind auto prices a full-depth verification (on a CPU it may never draft)
    gamma: Gamma = 4
    predictors: Path | None = None    # the draft provider's bundle; None: the one shipped
    threshold: float | None = None    # one threshold for every layer (overrides the target)
    rule: str = "argmax"              # argmax (SpecEE) | candidate (skips the head check)
    max_exit_error: float = MAX_EXIT_ERROR
    # exits whose error was not measured against the target (a forced threshold below 1, a
    # bundle without exit plans, one measured above it) run only when asked for by name:
    # unlike ee's, these exits are not checked, so their errors reach the output
    unsafe: bool = False

    def __post_init__(self) -> None:
        _ = (self.spec, self.ee)   # each checks its own fields (one error, one place)
        # a threshold of 1 never fires, so it cannot cost quality
        if self.threshold is not None and self.threshold < 1.0 and not self.unsafe:
            raise SpeceeError(f"--threshold {self.threshold} exits without the quality target "
                              f"(its token error was never measured); use --max-exit-error, "
                              f"or add --unsafe-exits to run it anyway")

    @property
    def spec(self) -> SpecOptions:
        return SpecOptions(gamma=self.gamma, context=False)

    @property
    def ee(self) -> EEOptions:
        return EEOptions(provider="draft", predictors=self.predictors, threshold=self.threshold,
                         rule=self.rule, k=N_CAND, max_exit_error=self.max_exit_error)


class SpecEE(Mode):
    name = "spec-ee"
    Options = SpecEEOptions
    needs_draft = True
    lossless = False
    greedy_only = True
    help = "draft then verify, the verify batch exiting early together (greedy; lossy)"

    def start(self, llm, sampling, opts):
        from ..early_exit.costs import exit_costs
        from ..early_exit.mode import plan, predictors
        from ..engine.draft_attention import draft_attention
        from ..engine.steps import with_note
        from ..speculative.decode import generate_spec
        from ..speculative.mode import draft_policy
        from .verify import HyperVerifier

        pred = predictors(llm, opts.ee)
        policy = draft_policy(llm, opts.spec, kind=opts)
        draft_attention(llm)
        note_gamma = (f"draft {llm.draft_path.name}, gamma {opts.gamma}"
                      + ("" if not policy.plan_is_plain else
                         ": never drafts on this machine's measured costs (plain decoding)"))

        # a batch exits only where every deciding row settles: each layer's probe is priced
        # with this machine's costs (early_exit/costs.py), except where exits are forced to
        # be measured (--unsafe-exits)
        costs = None if opts.unsafe else exit_costs(llm, pred)

        def run(tokens, max_new):
            thresholds, sched, note = plan(llm, pred, opts.ee, costs,
                                          refuse_unmeasured=not opts.unsafe)
            verifier = HyperVerifier(pred, sched, thresholds, opts.rule)
            return with_note(generate_spec(llm.tgt.seq, llm.dft.seq, tokens, policy, sampling,
                                           verifier=verifier, max_new=max_new,
                                           is_eog=llm.model.is_eog),
                             f"{note_gamma}; {note}")

        return run

    def prepare(self, llm, opts, status=no_status) -> None:
        from ..engine import modes

        modes.get("spec").prepare(llm, opts.spec, status)   # a cost-aware gamma's table

    def describe(self, opts) -> str:
        return (f"specee-cpp --mode spec-ee gamma {opts.gamma} {opts.rule} "
                f"{describe_target(opts)}" + (" --unsafe-exits" if opts.unsafe else ""))


register(SpecEE())

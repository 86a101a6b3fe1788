"""Mode ``spec``: draft then verify, the draft length chosen each round by a policy.

Its options, and what it derives from and learns on a loaded pair, in one `PairState`:
the machine's cost model (measured on first use, cached on disk per machine), the fitted
acceptance model (the controller shipped for the draft, or one given as an option), and
the guards, corrections and verification scales its runs learn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from ..config import SLOT_STEP
from ..engine.draft_attention import draft_attention
from ..engine.modes import Mode, in_a_slot, no_status, register
from ..engine.plain import PLAIN
from ..engine.steps import with_note
from ..errors import SpeceeError
from ..paths import BUNDLE_DIR
from .policies import NEEDS_COSTS, NEEDS_MODEL, POLICY_NAMES, context_guard

Gamma = int | Literal["auto", "stop", "pmin", "hf", "speckv"]


def parse_gamma(text: str) -> Gamma:
    """A command line's --gamma: a number of tokens or a policy name."""
    text = text.strip().lower()
    return int(text) if text.isdigit() else text


@dataclass(frozen=True)
class SpecOptions:
    gamma: Gamma = "auto"             # tokens drafted per round, or a policy name
    controller: Path | None = None    # fitted acceptance model; None: the one shipped
    # auto/stop: also draft for free from the context (prompt and output so far) in the
    # rounds where that is predicted to beat plain decoding (speculative/context_drafter.py)
    context: bool = True
    # also draft from this user's earlier outputs, kept on this machine (speculative/history.py);
    # opt-in, and only with the context drafts of auto/stop
    history: bool = False

    def __post_init__(self) -> None:
        g = self.gamma
        ok = (isinstance(g, int) and not isinstance(g, bool) and g >= 0) or g in POLICY_NAMES
        if not ok:
            raise SpeceeError(f"gamma must be a number of tokens >= 0 or one of "
                              f"{', '.join(POLICY_NAMES)}, got {g!r}")
        if self.history and (g not in NEEDS_COSTS or not self.context):
            raise SpeceeError(f"--history drafts from earlier outputs alongside the context "
                              f"drafts of --gamma auto or stop, not with gamma {g}"
                              + ("" if self.context else " and --no-context"))
        if self.controller is not None:
            object.__setattr__(self, "controller", Path(self.controller))


@dataclass
class PairState:
    """What speculative decoding derives from and learns on one loaded pair, made once per
    LLM (``pair_state``) and kept as long as it. The derived parts are read on first use
    (``get``); the learned ones are kept per mode and options, since a guard's verdict or a
    correction is about those rounds, and the verification scale per cost table, since it
    is about the machine."""

    costs: Any = None                  # cost.CostModel: this machine's, or one given
    costs_given: Any = None            # the costs given (use_cost_model): taken as they are
    base_sha256: dict[Path, str] = field(default_factory=dict)   # the draft's base file
    controllers: dict[Path, Any] = field(default_factory=dict)   # AcceptanceModel per path
    copy_model: Any = None             # CopyModel, or None where none is shipped
    copy_model_read: bool = False
    variant_note: str | None = None    # NAME:auto's choice, made once
    history: Any = None                # HistoryDrafts, made on first use
    guards: dict[tuple, Any] = field(default_factory=dict)        # (kind, opts) -> Guard
    corrections: dict[tuple, Any] = field(default_factory=dict)   # (kind, opts) -> Correction
    verify_scales: dict[int, Any] = field(default_factory=dict)   # id(costs) -> VerifyScale
    idle: Any = None                   # idle.IdleCosts: the table measured in idle time
    estimate: Any = None               # cost.CostTable: the first estimate (estimated_costs)

    @staticmethod
    def get(table: dict, key, make: Callable[[], Any]) -> Any:
        if key not in table:
            table[key] = make()
        return table[key]


def pair_state(llm) -> PairState:
    """The loaded pair's `PairState` (one per LLM)."""
    return llm.cached(("speculative",), PairState)


def controller_path(draft_sha256: str) -> Path:
    """The shipped acceptance model of a draft (it serves any quantization of its target)."""
    return BUNDLE_DIR / f"controller-{draft_sha256[:16]}.npz"


def base_sha256(llm) -> str:
    """The sha256 of the model the draft is made from (itself, or a ``NAME:TYPE``/``NAME:vN``
    variant's registry model): keys the shipped controller, which serves its variants."""
    from ..models.pull import file_sha256

    base = llm.draft_base_path or llm.draft_path
    return PairState.get(pair_state(llm).base_sha256, base, lambda: file_sha256(base))


def cost_key(llm, measure: bool = True, progress=None) -> tuple[str, dict] | None:
    """(cache key, machine record) of the pair's cost table on this machine. The kernels that
    read prompts come first (the table's prices of reading one are theirs): measured now
    where ``measure``, else None while they are not measured yet."""
    from ..engine.timing import run_steps

    return run_steps(cost_key_steps(llm, measure, progress))


def cost_key_steps(llm, measure: bool = True, progress=None):
    """:func:`cost_key`, its measurement taken a batch at a time."""
    from ..bindings import kernel_switch
    from ..engine.prompt_kernels import prompt_kernels_known, prompt_kernels_steps
    from ..provenance import machine, machine_id
    from .cost import MEASURE_VERSION

    if not measure and not prompt_kernels_known(llm):
        return None
    llm.prompt_kernels = yield from prompt_kernels_steps(llm, measure=measure,
                                                         progress=progress)
    # the machine (CPU features, build, threads, AMX switch) is part of the key, and so
    # are the kernel choices measured for this target: a cache copied to another
    # machine, a rebuilt library or another choice measures again
    where = machine(llm.config.threads)
    chosen = llm.decode_kernels.key()
    chosen += [f"{name}={kernel_switch(name)}" for name in llm.prompt_kernels]
    if chosen:
        where = {**where, "kernels": "; ".join(chosen)}
    return (f"{llm.model.sha256[:12]}-{llm.draft_sha256()[:12]}"
            f"-m{machine_id(where)}-v{MEASURE_VERSION}"), where


def estimate_key(llm) -> str:
    """Cache key of the first estimate of the pair's costs on this machine: the machine and
    the decode kernels chosen at load, not the prompt kernels (measured after it: they price
    prompt batches, which it does not time)."""
    from ..provenance import machine, machine_id
    from .cost import MEASURE_VERSION

    where = machine(llm.config.threads)
    if llm.decode_kernels.values:
        where = {**where, "kernels": "; ".join(llm.decode_kernels.key())}
    return (f"estimate-{llm.model.sha256[:12]}-{llm.draft_sha256()[:12]}"
            f"-m{machine_id(where)}-v{MEASURE_VERSION}")


def estimated_costs(llm):
    """The first estimate of this machine's costs for the pair (cost.estimate_steps, taken
    first in idle time and cached), or None where it is not taken yet: measures nothing."""
    from .cost import load_cached

    state = pair_state(llm)
    if state.estimate is None and llm.draft_path is not None:
        state.estimate = load_cached(estimate_key(llm))
    return state.estimate


def estimate_verdict(costs) -> str:
    """What a first estimate says of the draft model: "pays" or "loses" where its verdict
    lies clearly (NEAR_MARGIN) on one side of the threshold, else "near" (the table that
    refines it decides)."""
    from ..config import NEAR_MARGIN
    from .variants import drafting_margin

    m = drafting_margin(costs)
    return "pays" if m >= 1.0 + NEAR_MARGIN else "loses" if m <= 1.0 - NEAR_MARGIN else "near"


def cost_model(llm, progress=None):
    """This machine's speculative cost table for the loaded pair, at a short and a long
    context (measured on first use, 1.5-2 min with the default pair on 2 cores, telling
    ``progress`` where it is; then cached under ``$SPECEE_CPP_HOME/costs``)."""
    if llm.draft_path is None:
        raise SpeceeError("a cost model needs a draft model (--draft)")

    def make():
        from dataclasses import replace

        from ..config import COST_PROMPT
        from ..engine.timing import run_steps
        from .cost import implausible, load_or_measure, steady_table_steps, table_from
        from .variants import drafting_margin

        key, where = cost_key(llm, measure=True, progress=progress)
        prompt = llm.prompt_tokens(COST_PROMPT)

        def measure():
            # the draft's attention first: the table's draft costs are measured with it
            if progress is not None:
                progress("the draft's flash attention, on and off")
            fa, seen = draft_attention(llm)
            state: dict = {}
            run_steps(steady_table_steps(llm.tgt.seq, llm.dft.seq, prompt, state,
                                         drafting_margin, progress=progress))
            # emptied, not kept for the next prefill: the cost context shares the chat
            # template's first tokens with a prompt, and cells read in its batches round
            # otherwise than a fresh read, so a near tie in the next answer would go by
            # the measurement, not by the prompt
            llm.reset()
            return replace(table_from(state), machine=where, draft_flash_attn=fa,
                           draft_attention=seen)

        # a table still disturbed after its repeats prices this run, and is measured again
        table = load_or_measure(key, measure, keep=lambda t: implausible(t) is None)
        draft_attention(llm)   # the setting the draft runs with (the table's is a record)
        return table

    state = pair_state(llm)
    if state.costs is None:
        state.costs = make()
    return state.costs


def idle_costs(llm, log=None):
    """The pair's measurement in idle time (speculative/idle.py), made on first use; ``log``
    (a line printer) is where it says what it measures."""
    from .idle import IdleCosts

    state = pair_state(llm)
    if state.idle is None:
        state.idle = IdleCosts(llm, log)
    elif log is not None:
        state.idle.log = log
    return state.idle


def deferred(llm, opts: SpecOptions) -> bool:
    """Whether this run starts before this machine's costs are known (``LLM.defer_costs``,
    set by chat, generate and serve): they are measured in idle time meanwhile."""
    return bool(getattr(llm, "defer_costs", False)) and needs_costs(llm, opts) \
        and idle_costs(llm).pending()


def idle_costs_job(llm, mode, opts, log=None):
    """The measurement a command runs in its idle time for a run of ``mode`` with ``opts``
    (speculative/idle.py), or None where that run needs none."""
    if not isinstance(opts, SpecOptions) or not deferred(llm, opts):
        return None
    return idle_costs(llm, log)


def measured_costs(llm):
    """The pair's cost table if this machine has measured it (cached), else None: measures
    nothing."""
    from .cost import load_cached

    state = pair_state(llm)
    if state.costs is None and llm.draft_path is not None:
        key = cost_key(llm, measure=False)
        table = load_cached(key[0]) if key is not None else None
        if table is not None:
            draft_attention(llm)   # measured with the table: read from its cache
            state.costs = table
    return state.costs


def use_cost_model(llm, costs) -> None:
    """Decide with these costs for this pair instead of measuring (say, a GPU's shape from
    ``simulate.gpu_like``, to see what the controller would do there): taken as given, not
    rescaled by what this machine's batches are seen to cost (``verify_scale``)."""
    state = pair_state(llm)
    state.costs = state.costs_given = costs


def forget_costs(llm) -> None:
    """Measure (or read this machine's cached table) again on next use: another draft file
    was loaded, or given costs are no longer wanted."""
    state = pair_state(llm)
    state.costs = state.costs_given = None


def acceptance_model(llm, path: Path | None = None):
    """The fitted acceptance model (``path``, else the one shipped for the draft), refused
    for a target of another shape than it was fitted on."""
    from .acceptance import AcceptanceModel

    shipped = controller_path(base_sha256(llm))
    path = path or shipped

    def make():
        if path == shipped and not path.is_file():
            raise SpeceeError(f"no shipped draft-length controller for draft "
                              f"{llm.draft_path.name}; pass a fixed --gamma N or fit "
                              f"one with specee-cpp fit-controller")
        model = AcceptanceModel.load(path)
        shape = [llm.model.info.arch, llm.model.n_layer, llm.model.n_embd]
        if model.meta.get("target_shape", shape) != shape:
            raise SpeceeError(f"controller {path.name} was fitted for a target of shape "
                              f"{model.meta['target_shape']}, not {shape}")
        return model

    return PairState.get(pair_state(llm).controllers, path, make)


def has_controller(llm, opts: SpecOptions) -> bool:
    return opts.controller is not None or controller_path(base_sha256(llm)).is_file()


def cost_model_shown(llm, status, text: str):
    """:func:`cost_model` under the status line ``status(text)``, whose text follows the
    first measurement's progress where it can be updated (a rich Status)."""
    with status(text) as shown:
        progress = ((lambda what: shown.update(f"{text}: {what}"))
                    if hasattr(shown, "update") else None)
        return cost_model(llm, progress=progress)


def needs_costs(llm, opts: SpecOptions) -> bool:
    """Whether a run with these options reads this machine's cost table (the first one
    measures it, 1.5-2 min with the default pair on 2 cores, then it is cached)."""
    return opts.gamma in NEEDS_COSTS and (opts.context or has_controller(llm, opts))


def copy_model(llm):
    """The copy model fitted for this target (context_acceptance.py), or None where none is
    shipped: the context drafter then uses its built-in guess."""
    from .context_acceptance import CopyModel, bundle_path

    state = pair_state(llm)
    if not state.copy_model_read:
        path = bundle_path(llm.model.sha256)
        state.copy_model = CopyModel.load(path) if path.is_file() else None
        state.copy_model_read = True
    return state.copy_model


def choose_variant(llm, status=no_status) -> str:
    """For ``--draft NAME:auto``: this machine's best variant of the draft
    (speculative/variants.py), chosen once per machine and kept, since a run that does not
    wait for measurements (chat, generate, serve) drafts only once it finds the choice;
    returns the note saying which and why."""
    from .variants import choose, remember_choice, remembered_choice

    state = pair_state(llm)
    if state.variant_note is None:
        state.variant_note = remembered_choice(llm)
    if state.variant_note is None:
        state.variant_note = choose(llm, llm.draft_auto, status)
        remember_choice(llm, state.variant_note)
    return state.variant_note


class HistoryDrafts:
    """The history store of a pair's tokenizer and its trie, loaded once per LLM; each
    generation's output is added to both when it ends (also when it is stopped)."""

    def __init__(self, fingerprint: str):
        from .history import History

        self.store = History(fingerprint)
        self.trie = self.store.trie()

    def recording(self, steps, is_eog):
        out: list[int] = []
        try:
            for step in steps:
                out.append(step.token)
                yield step
        finally:
            close = getattr(steps, "close", None)
            if close:
                close()
            while out and is_eog(out[-1]):
                out.pop()
            if out:
                self.store.add(out)
                self.trie.extend(out)
                self.trie.cut()


def history_drafts(llm) -> HistoryDrafts:
    state = pair_state(llm)
    if state.history is None:
        state.history = HistoryDrafts(llm.model.info.tokenizer_fingerprint)
    return state.history


def draft_policy(llm, opts: SpecOptions, kind: object = "spec", costs=None):
    """A fresh draft-length policy for one generation (policies keep per-run state), whose
    guard (what drafted rounds really reached against plain steps) lives as long as the
    loaded pair and these options: a chat's next turn, the server's next request and a
    bench's next prompt start from what the last generations learned, instead of paying
    again for the drafted rounds that teach a fresh guard that drafting loses here (in
    64-token answers that was most of the answer); so does the correction of the round model
    (what its predicted acceptance came to on this pair). A wait left over is dropped
    (``Guard.begin``): each prompt gets a probe. ``kind`` keeps apart the guards
    of modes that verify differently (spec-ee passes its own options). ``costs``: the table
    to price rounds with (None: this machine's, ``cost_model``)."""
    from .policies import CostAware, make_policy

    g = opts.gamma
    if costs is None and g in NEEDS_COSTS:
        costs = cost_model(llm)
    # a draft is verified in one decode: in a server's slot, one step of the slots
    rows = llm.tgt.ctx.n_batch
    if isinstance(g, int) and g >= rows:
        raise SpeceeError(f"gamma must be in [0, {rows}), got {g}")
    policy = make_policy(g, model=acceptance_model(llm, opts.controller) if g in NEEDS_MODEL
                         else None,
                         costs=costs if g in NEEDS_COSTS else None,
                         bpw=llm.model.bits_per_weight)
    state = pair_state(llm)
    if policy.guard is not None:
        policy.guard = PairState.get(state.guards, (kind, opts), lambda: policy.guard)
        policy.guard.begin()
    if policy.correction is not None:
        # the bench's A/B options may turn the correction or the scale off
        # (bench.configs.SpecBenchOptions); a user's SpecOptions has neither switch
        policy.correction = PairState.get(state.corrections, (kind, opts),
                                          lambda: policy.correction) \
            if getattr(opts, "correction", True) else None
    scale = verify_scale(llm, costs) if isinstance(policy, CostAware) \
        and getattr(opts, "model_scale", True) else None
    if scale is not None:   # the context drafter's (Spec.start): one per pair and table
        policy.use_scale(scale)
    return policy


def verify_scale(llm, costs):
    """What verification batches really cost on this machine against its table ``costs``
    (cost.VerifyScale), learned from the context drafter's rounds and the draft model's and
    kept with the pair and that table: unlike the guard's verdicts it is the machine's,
    whatever the prompt. None for costs given with ``use_cost_model``: taken as they are."""
    from .cost import VerifyScale

    state = pair_state(llm)
    if state.costs_given is costs:
        return None
    return PairState.get(state.verify_scales, id(costs), VerifyScale)


def spec_runner(llm, sampling, dft, policy, hist, note: str, context_for):
    """A spec run's start function: each generation drafts with ``dft`` as ``policy`` says
    and from the source ``context_for(prediction)`` makes (None: no free drafts; the
    prediction a ``Prediction`` or None), records its output in ``hist`` where given, and
    carries ``note``."""
    from .decode import generate_spec
    from .prediction import Prediction

    def run(tokens, max_new, prediction=None):
        context = context_for(Prediction(prediction) if prediction else None)
        steps = generate_spec(llm.tgt.seq, dft, tokens, policy, sampling, context=context,
                              max_new=max_new, is_eog=llm.model.is_eog)
        if hist is not None:
            steps = hist.recording(steps, llm.model.is_eog)
        return with_note(steps, note)

    return run


def _prediction_only(llm, sampling, pred):
    """The free drafter of a run that drafts from no context: the prediction alone, if any."""
    from .prediction import prediction_drafter

    return prediction_drafter(llm, pred, sampling) if pred else None


class Spec(Mode):
    name = "spec"
    Options = SpecOptions
    needs_draft = True
    takes_prediction = True
    runs_in_slots = True      # drafting from the context and the prediction only (_in_slot)
    help = "draft then verify (lossless); --gamma picks the draft length"

    def needs_draft_in(self, slot: bool) -> bool:
        # a slot drafts from its context and the prediction, from the draft model only at
        # a fixed gamma where the server runs one in its slots (refused_with_slots says so)
        return not slot

    def refused_with_slots(self, n: int, opts=None, draft: bool = False) -> str | None:
        if n > 1 and opts is not None:
            g = opts.gamma
            if isinstance(g, int) and g > 0 and not draft:
                return (f"gamma {g} drafts with a draft model, which the slots of "
                        f"--parallel {n} run only where the server starts with --draft "
                        f"(gamma auto or stop draft from the context and the prediction)")
            if isinstance(g, int) and g >= SLOT_STEP:
                return (f"gamma {g} does not fit a step of the slots of --parallel {n}, "
                        f"which verifies a draft and the token before it in at most "
                        f"{SLOT_STEP} rows: at most gamma {SLOT_STEP - 1}")
            if not isinstance(g, int) and g not in NEEDS_COSTS:
                return (f"gamma {g} sizes drafts for one request at a time: the slots of "
                        f"--parallel {n} draft at a fixed --gamma N or gamma auto or stop")
            if opts.history:
                return (f"history drafts from one user's earlier outputs: not served with "
                        f"--parallel {n}, whose slots serve anyone's requests")
        return super().refused_with_slots(n, opts)

    def start(self, llm, sampling, opts):
        if in_a_slot(llm):
            return self._in_slot(llm, sampling, opts)
        if deferred(llm, opts):
            estimate = estimated_costs(llm)
            if estimate is None:
                return self._provisional(llm, sampling, opts)
            return self._drafting(llm, sampling, opts, lambda: estimate, estimated=True)
        chosen = choose_variant(llm) if llm.draft_auto and opts.gamma in NEEDS_COSTS else ""
        return self._drafting(llm, sampling, opts, lambda: cost_model(llm), chosen=chosen)

    def _drafting(self, llm, sampling, opts, table: Callable[[], Any], chosen: str = "",
                  estimated: bool = False):
        """A run priced by ``table()`` (read only where the options need costs): this
        machine's measured table, or while that is measured in idle time its first estimate
        (``estimated``), whose verdict on the draft model is taken only where it is clear."""
        from .policies import FixedGamma
        from .context_drafter import ContextSource, free_draft_max
        from .variants import MODEL_DRAFT_MARGIN, WORK_LEVELS, model_drafting_pays

        cost_aware = opts.gamma in NEEDS_COSTS
        why = ""
        if cost_aware and not has_controller(llm, opts):
            # the cost-aware default on a draft nobody fitted a controller for: no model
            # drafting (an error would break `--draft` for every other draft), say so
            policy = FixedGamma(0)
            why = (f"no draft-length controller for {llm.draft_path.name} (fit one with "
                   f"specee-cpp fit-controller, or pass --gamma N)")
        elif estimated and (verdict := estimate_verdict(table())) != "pays":
            policy = FixedGamma(0)
            why = ("model drafting " + ("is estimated not to pay" if verdict == "loses"
                                        else "is near its threshold")
                   + " on a first estimate of this machine's costs; the full measurement "
                     "(while idle) decides")
        else:
            policy = draft_policy(llm, opts, costs=table() if cost_aware else None)
            whose = "estimated" if estimated else "measured"
            if policy.plan_is_plain and cost_aware:
                why = f"model drafting cannot pay on this machine's {whose} costs"
            elif cost_aware and not model_drafting_pays(table()):
                policy = FixedGamma(0)
                why = (f"model drafting gains under {MODEL_DRAFT_MARGIN - 1:.0%} at every "
                       f"acceptance {WORK_LEVELS[0]}-{WORK_LEVELS[-1]} on this machine's "
                       f"{whose} costs")
        if chosen and policy.plan_is_plain:
            why = f"{why}; {chosen}" if why else chosen
        with_context = cost_aware and opts.context
        if policy.plan_is_plain and not with_context:
            return self._plain(llm, sampling, f"gamma {opts.gamma}: plain decoding"
                               + (f", {why}" if why else ""))
        costs = table() if with_context else None
        if policy.plan_is_plain:
            if not estimated:   # else the draft stays loaded for the measurement
                llm.release_draft()   # only free drafts from the context will be tried
            note = (f"gamma {opts.gamma}: drafts from the context where they pay, else "
                    f"plain; {why}" + ("" if estimated else "; draft not in memory"))
        else:
            note = (f"draft {llm.draft_path.name}, gamma {opts.gamma}"
                    + (", and drafts from the context where they pay" if with_context else ""))
        if chosen and not policy.plan_is_plain:
            note += f"; {chosen}"
        if estimated:
            note += ("; priced by a first estimate of this machine's draft/verify costs (a "
                     "few timed steps), refined while idle")
        idle = pair_state(llm).idle
        if idle is not None and idle.done and not idle.announced and not estimated:
            idle.announced = True
            note += "; this machine's costs were measured while idle and are in use from now"
        copy = copy_model(llm) if with_context else None
        if copy is not None:
            note += " (acceptance by the copy model fitted for this target)"
        dft = None
        if not policy.plan_is_plain:
            if not estimated:   # an estimate was timed with the setting the draft has now
                draft_attention(llm)   # before the draft's context is first used
            dft = llm.dft.seq
        hist = history_drafts(llm) if opts.history else None
        if hist is not None:
            note += f"; and from your {len(hist.trie)} earlier output tokens"

        follow_max = free_draft_max(sampling)

        def context_for(pred):
            if with_context:
                return ContextSource(costs, history=hist.trie if hist else None, model=copy,
                                     follow_max=follow_max, is_eog=llm.model.is_eog,
                                     guard=context_guard(costs),
                                     verify_scale=verify_scale(llm, costs), prediction=pred)
            return _prediction_only(llm, sampling, pred)

        return spec_runner(llm, sampling, dft, policy, hist, note, context_for)

    def _provisional(self, llm, sampling, opts):
        """A run before this machine's costs are known: drafts from the context (and the
        prediction) priced at the dearest verification measured on any machine, no draft
        model (its costs decide whether it pays at all); the draft stays loaded for the
        measurement that runs in idle time."""
        note = ("this machine's draft/verify costs are not measured yet (they are measured "
                "while idle): drafts from the context at prices safe on any machine, no "
                "draft model until then")
        if not has_controller(llm, opts):
            note += (f"; no draft-length controller for {llm.draft_path.name} (fit one with "
                     f"specee-cpp fit-controller, or pass --gamma N)")
        return self._context_only(llm, sampling, opts, note)

    def _in_slot(self, llm, sampling, opts):
        """A slot of a server decoding several requests at once (engine/slots.py). At a fixed
        gamma the draft model drafts, a sequence of its context a slot, its rows batched
        across the slots as the target's are. Else drafts from the slot's own context and
        prediction, priced as a run before this machine's costs are known (the dearest
        verification rows measured anywhere), and no draft model: a drafted row's price
        there is its share of a step that every slot waits for, while the token it may save
        is worth that step's time over the slots' tokens, less than a plain step of one
        sequence: drafts have to be likelier to hold than alone before they pay, which the
        dearer prices ask of them; the draft model's costs were measured alone."""
        if why := self.refused_with_slots(llm.n_slots, opts, draft=llm.slots_draft):
            raise SpeceeError(why)
        if isinstance(opts.gamma, int):
            note = (f"a slot of several: draft {llm.draft_path.name}, gamma {opts.gamma}"
                    if opts.gamma else "a slot of several: gamma 0")
            dft = llm.dft.seq if opts.gamma else None
            return spec_runner(llm, sampling, dft, draft_policy(llm, opts), None, note,
                               lambda pred: _prediction_only(llm, sampling, pred))
        return self._context_only(llm, sampling, opts, "a slot of several: drafts from the "
                                  "context and the prediction, no draft model")

    def _context_only(self, llm, sampling, opts, note: str):
        """Drafts from the context (and the prediction) at provisional prices, none from a
        draft model."""
        from .context_drafter import ContextSource, free_draft_max
        from .idle import provisional_costs

        costs = provisional_costs() if opts.context else None
        copy = copy_model(llm) if opts.context else None
        hist = history_drafts(llm) if opts.history else None

        def context_for(pred):
            if costs is None and pred is None:
                return None
            return ContextSource(costs, history=hist.trie if hist else None, model=copy,
                                 follow_max=free_draft_max(sampling), is_eog=llm.model.is_eog,
                                 prediction=pred)

        return spec_runner(llm, sampling, None, 0, hist, note, context_for)

    def prepare(self, llm, opts, status=no_status) -> None:
        if in_a_slot(llm) or deferred(llm, opts):
            return   # a slot prepares nothing; otherwise measured in idle time
        if llm.draft_auto and needs_costs(llm, opts):
            choose_variant(llm, status)
        if needs_costs(llm, opts):
            cost_model_shown(llm, status, "reading this machine's draft/verify costs (first "
                             "time: 1.5-2 minutes, then cached)")

    def _plain(self, llm, sampling, note: str):
        """Plain decoding for a run that will not draft; the draft's memory goes back."""
        llm.release_draft()
        start = PLAIN.start(llm, sampling, PLAIN.Options())
        return lambda tokens, max_new, prediction=None: with_note(
            start(tokens, max_new, prediction=prediction), note + "; draft not in memory")

    def describe(self, opts) -> str:
        return (f"specee-cpp --mode spec gamma {opts.gamma}"
                + ("" if opts.context or opts.gamma not in NEEDS_COSTS else " --no-context")
                + (" --history" if opts.history else "")
                + ("" if getattr(opts, "correction", True) or opts.gamma != "auto"
                   else " (round model uncorrected, a bench-only option)")
                + ("" if getattr(opts, "model_scale", True) or opts.gamma not in NEEDS_COSTS
                   else " (model drafts priced by the table as measured, a bench-only "
                        "option)"))


register(Spec())


def _give_predictions() -> None:
    from ..engine.predicted import provided_by
    from .prediction import generate_predicted, prediction_drafter

    provided_by(generate_predicted, prediction_drafter)


_give_predictions()

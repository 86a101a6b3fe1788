"""Draft-length policies: one interface, consulted by ``generate_spec`` every round.

    plan(at, rival_tps)    -> most tokens to draft this round (0: a plain step); ``at``
                              says where the round starts (`RoundAt`), ``rival_tps`` what a
                              free draft from the context is expected to reach instead
    keep(i, top1, entropy) -> after drafting token i: keep it, or drop it and stop
    more(i)                -> after keeping token i: draft token i + 1?
    update(outcome)        after the target's verdict (`Outcome`)
    reads_prompt(at)       whether the draft reads the prompt up front, and
    prompt_read(seconds, n_tokens) what that read cost

A policy's own rule is ``choose()`` (what ``plan`` returns when no rival wins).
``needs_confidence`` says whether keep/update read the draft's top-1 probability and
entropy (a softmax over the vocabulary per drafted token, skipped when no policy reads it).

Ours are cost-aware: they maximise expected tokens per second with the measured per-machine
cost model (``speculative.cost``), so gamma 0 is chosen wherever drafting cannot pay, which on a
2-core CPU with a 0.5B draft is everywhere. SpecKV's objective (tokens per step) and the
fixed/heuristic rules ignore cost; they are here as baselines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import (CONTEXT_STEP, EXPLORE_EVERY, EXPLORE_HORIZON, GUARD_FIRST_BACKOFF,
                      GUARD_MAX_BACKOFF, GUARD_WINDOW, HF_MAX, HF_START, MAX_GAMMA,
                      MODEL_GUARD_MEMORY, PMIN_P, ROUND_CATCH_UP)
from ..errors import SpeceeError
from .acceptance import AcceptanceModel, Correction, round_stats
from .cost import CostModel, CostTable, as_table


@dataclass(frozen=True)
class RoundAt:
    """Where a round starts: the cache holds ``n_tokens`` (cost-aware policies read their
    costs at this length), the draft model is ``behind`` tokens behind the target (what a
    drafted round would first catch it up on) and the caller takes at most ``room`` more
    tokens (None: no limit)."""
    n_tokens: int
    behind: int = 0
    room: int | None = None


@dataclass(frozen=True)
class Outcome:
    """A round's outcome: ``n_drafted`` tokens drafted (0: a plain step), ``n_accept`` of
    them accepted, the draft's confidence per drafted token, the round's ``seconds`` of
    which ``catch_up`` went to bringing the draft up to date on the ``behind`` tokens it
    had missed; ``tried``: the draft model ran
    (a round whose drafts were all dropped by keep() is a plain step that paid for a draft
    token). ``verify_rows``: a full-depth target batch of that many rows (1: a plain step)
    was timed at ``verify_s`` (0: none to learn from)."""
    n_drafted: int
    n_accept: int
    top1: Sequence[float] = ()
    entropy: Sequence[float] = ()
    seconds: float = 0.0
    tried: bool = False
    catch_up: float = 0.0
    behind: int = 0
    verify_rows: int = 0
    verify_s: float = 0.0


class DraftPolicy:
    name = "policy"
    needs_confidence = False
    plan_is_plain = False   # True: plan() is always 0, so plain decoding can run instead
    guard: Guard | None = None   # the cost-aware policies': what drafting really reached
    correction: Correction | None = None   # ours: the round model against real rounds
    behind, room = 0, None       # the round being planned's (`RoundAt`)

    def plan(self, at: RoundAt | None = None, rival_tps: float | None = None) -> int:
        """Most tokens to draft in the round starting ``at`` (None: where the last one did);
        0 where a free draft expected at ``rival_tps`` beats this policy's best round."""
        if at is not None:
            self._at(at)
        if rival_tps is not None and self.predicted_tps() <= rival_tps:
            return 0
        return self.choose()

    def choose(self) -> int:
        """The policy's own rule: most tokens to draft this round."""
        raise NotImplementedError

    def keep(self, i: int, top1: float, entropy: float) -> bool:
        return True

    def more(self, i: int) -> bool:
        """After keeping token i: draft token i + 1 (within plan()'s budget)?"""
        return True

    def update(self, o: Outcome) -> None:
        """After a round. A policy with a guard has it judge the round."""
        if self.guard is not None and o.seconds > 0:
            self.guard.observe(o.n_drafted or o.tried, o.n_accept + 1, o.seconds, o.catch_up,
                               o.behind, self._one_draft_decode_s)

    def reads_prompt(self, at: RoundAt) -> bool:
        """Whether the draft reads the prompt up front, in prefill: ``at.behind`` tokens it
        has not seen (the prompt, less what its cache already holds), ``at.room`` the most
        tokens the caller takes after the first. Yes unless the policy never drafts or its
        guard holds it at plain decoding for now; a prompt not read is the first drafted
        round's catch-up."""
        self._at(at)
        return not self.plan_is_plain and not self._waiting()

    def prompt_read(self, seconds: float, n_tokens: int) -> None:
        """The draft read ``n_tokens`` of prompt up front in ``seconds``: a batch like any
        catch-up, whose price per token a guard learns from."""
        if self.guard is not None and n_tokens > ROUND_CATCH_UP:
            self.guard.learn_catch_up(seconds, n_tokens, self._one_draft_decode_s)

    def predicted_tps(self) -> float:
        """The tokens per second this policy expects of its next drafted round on this
        machine (0: it has no prediction), so that a free draft from the context can be
        weighed against the draft model."""
        return 0.0

    def _at(self, at: RoundAt) -> None:
        self.behind, self.room = at.behind, at.room

    def _waiting(self) -> bool:
        """Whether the policy holds at plain decoding for now (its guard backed off)."""
        return self.guard is not None and self.guard.wait > 0

    @property
    def _one_draft_decode_s(self) -> float:
        """Seconds of one draft decode at the current costs (0: no cost model): the fixed
        part of any catch-up batch, which the guard's per-token catch-up cost leaves out."""
        return 0.0


class FixedGamma(DraftPolicy):
    def __init__(self, gamma: int):
        self.gamma, self.name = gamma, f"fixed-{gamma}"
        self.plan_is_plain = gamma == 0

    def choose(self) -> int:
        return self.gamma


class PMinRule(DraftPolicy):
    """llama.cpp's draft-simple rule: draft up to n_max, stop at the first token whose
    draft probability is below p_min (that token is not drafted)."""

    needs_confidence = True

    def __init__(self, n_max: int = MAX_GAMMA, p_min: float = PMIN_P):
        self.n_max, self.p_min, self.name = n_max, p_min, f"pmin-{p_min:g}-max{n_max}"

    def choose(self) -> int:
        return self.n_max

    def keep(self, i: int, top1: float, entropy: float) -> bool:
        return top1 >= self.p_min


class HFHeuristic(DraftPolicy):
    """Hugging Face assisted generation's "heuristic" schedule: +2 after a round whose
    drafts were all accepted, -1 otherwise (at least 1)."""

    name = "hf-heuristic"

    def __init__(self, start: int = HF_START, n_max: int = HF_MAX):
        self.n, self.n_max = start, n_max

    def choose(self) -> int:
        return self.n

    def update(self, o: Outcome) -> None:
        if o.n_drafted:
            self.n = min(self.n + 2, self.n_max) if o.n_accept == o.n_drafted \
                else max(1, self.n - 1)


class Guard:
    """What rounds really cost, here and now. The cost model is measured once, at a short
    context, and the acceptance model is fitted on other prompts; either can be optimistic.
    The guard keeps the speed actually reached by drafted rounds (their tokens over their
    seconds, both summed with a decay of 1/``memory`` a round) and a moving average of plain
    steps' (the cost model's plain speed until one is seen). Once ``window`` drafted rounds
    run slower than plain, it sends the policy to plain decoding for ``backoff`` steps, then
    lets ``window`` drafted rounds probe again, doubling the wait while probes keep losing.
    A single unlucky round (one token accepted of eight) is slower than plain on any
    machine, hence sums over several rounds; and sums, not an average of each round's
    tokens per second: rounds are either fully accepted or cut short (4 tokens in 64 ms or
    1 in 50 on HumanEval on the Zen 5), and an average of their rates weighs the short,
    rejected ones above their share of the time. The draft model's guard remembers
    ``MODEL_GUARD_MEMORY`` rounds: with 4, its running average of rates fell below plain
    after two or three rejected rounds at the end of one answer and the start of the next
    (tasks 8-9 of HumanEval 0-23), where its rounds overall ran 1.27x plain, and the
    verdicts' waits and doubled backoffs kept the model off for most of the next 6 answers.

    A round's time includes the draft's catch-up on what was emitted since it last ran (the
    tokens of free drafts from the context, plain steps chosen by the policy): a real cost
    of drafting with the model in between, large in copy-heavy work at long contexts. Only
    the first drafted round after a wait is judged without it: that catch-up is the wait's
    own length (or the whole prompt, when a generation started waiting), not a cost the
    rounds to come will pay.

    ``losing`` holds from a verdict against drafting until the next drafted round: while it
    holds, the policy does not pay a long catch-up to probe (see ``CostAwareGamma``)."""

    def __init__(self, plain_tps_prior: float, window: int = GUARD_WINDOW,
                 first_backoff: int = GUARD_FIRST_BACKOFF, max_backoff: int = GUARD_MAX_BACKOFF,
                 memory: int | None = None):
        self.plain_prior, self.window = plain_tps_prior, window
        self.alpha = 1.0 / window
        self.decay = 1.0 - 1.0 / (memory or window)   # what the drafted sums keep a round
        self.first, self.max = first_backoff, max_backoff
        self.plain: float | None = None
        self.tokens = self.seconds = 0.0   # drafted rounds' decayed sums
        self.n_judged = 0            # drafted rounds since the last verdict
        self.backoff, self.wait = first_backoff, 0
        self.waited = False          # a wait ran since the last drafted round
        self.losing = False          # the last verdict went against drafting, no probe since
        # catching the draft up on n tokens costs about one draft decode (the weights read
        # once) plus n times this, in plain steps as seen here (None: none seen yet); what a
        # drafted round after plain steps pays first
        self.catch_up_rel: float | None = None

    def begin(self) -> None:
        """A new generation with a guard kept from earlier ones: a wait left over is dropped.
        Its verdict stays (``losing``, the doubled backoff), so a losing guard probes again
        where the new prompt starts (``CostAwareGamma.reads_prompt``) and waits longer if
        the probe loses too. A wait carried into a new prompt kept its read back, and the
        draft, then far behind, was never probed for the whole answer: a code prompt after
        chat ones whose rounds had lost (MT-Bench dev on the AMX Xeon) ran plain, where
        alone it drafted 83% accepted at 1.6x plain."""
        self.wait = 0

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else old + self.alpha * (x - old)

    def plain_tps(self) -> float:
        return self.plain if self.plain is not None else self.plain_prior

    def drafted_tps(self) -> float | None:
        """The drafted rounds' speed as judged (None: none since the last verdict)."""
        return self.tokens / self.seconds if self.n_judged else None

    def gate(self, want: int) -> int:
        return 0 if self.hold() else want

    def hold(self) -> bool:
        """Whether the policy stays at plain decoding this step; each call while waiting
        is one step of the wait. A policy that calls it every step counts its wait in steps,
        whatever it would have drafted; one that calls ``gate`` only when it wants to draft
        counts those steps alone."""
        if self.wait > 0:
            self.wait -= 1
            self.waited = True
            return True
        return False

    def learn_catch_up(self, seconds: float, n_tokens: int, fixed: float) -> None:
        """The draft read ``n_tokens`` in one batch in ``seconds``, of which ``fixed`` (one
        draft decode) does not grow with the batch."""
        # kept relative to the plain steps seen, like the cost model's own units: a table
        # measured while the machine was busy reads dearer than today's steps
        rel = max(seconds - fixed, 0.0) / n_tokens * self.plain_tps()
        self.catch_up_rel = rel if self.catch_up_rel is None else \
            self.catch_up_rel + 0.5 * (rel - self.catch_up_rel)

    def observe(self, n_drafted: int, tokens: int, seconds: float,
                catch_up: float = 0.0, behind: int = 0, fixed: float = 0.0) -> None:
        """A round of ``tokens`` in ``seconds`` (``n_drafted`` 0: a plain step), of which
        ``catch_up`` fed the draft the ``behind`` tokens it had missed; ``fixed``: the
        seconds of one draft decode, the part of a catch-up that does not grow with it."""
        if not n_drafted:
            self.plain = self._ema(self.plain, tokens / seconds)
            return
        if catch_up > 0 and behind > 0:
            self.learn_catch_up(catch_up, behind, fixed)
        if self.waited:
            seconds, self.waited = max(seconds - catch_up, 1e-9), False
        self.losing = False
        # after a wait, the probe is judged on its own rounds, not the ones that lost before
        k = self.decay if self.n_judged else 0.0
        self.tokens, self.seconds = k * self.tokens + tokens, k * self.seconds + seconds
        self.n_judged += 1
        if self.n_judged < self.window:
            return
        if self.drafted_tps() < self.plain_tps():
            self.wait, self.losing = self.backoff, True
            self.backoff = min(2 * self.backoff, self.max)
            self.n_judged = 0
        else:
            self.backoff = self.first
            self.n_judged = self.window   # keep judging the running average


def context_guard(costs: CostModel | CostTable) -> Guard:
    """A fresh guard of the context's short drafts (context_drafter.py) for one generation.
    Unlike the draft model's (draft_policy), it is not kept with the pair: whether copying
    from the context pays depends on what this prompt holds, and a verdict carried from
    one prompt to the next held back the drafts of RAG and summary answers after QA ones
    (AMX Xeon first turns: rag 1.377x -> 1.005x of plain)."""
    return Guard(1.0 / as_table(costs).points[0].plain)


class _RoundModelPolicy(DraftPolicy):
    """Shared by the SpecKV objective and ours: predicted acceptance rate per candidate
    gamma from the last drafted round's statistics."""

    needs_confidence = True

    def __init__(self, model: AcceptanceModel, bpw: float, gammas=range(1, MAX_GAMMA + 1)):
        self.model, self.bpw = model, bpw
        self.gammas = np.array(list(gammas))
        self.feats = list(model.prior[:5]) + [bpw]
        self._rates_of: list | None = None   # the feats ``_rates`` last ran the net on

    def _rates(self) -> np.ndarray:
        """The round model's rates for every candidate gamma from the current features: the
        net runs again only after a drafted round changed them (every plain step asks, and
        the forward was a third of the control time of a generation that never drafts)."""
        if self._rates_of is not self.feats:
            self._rates_cached = self.model.rates(self.feats, self.gammas)
            self._rates_of = self.feats
        return self._rates_cached

    def update(self, o: Outcome) -> None:
        n_drafted, n_accept = o.n_drafted, o.n_accept
        if n_drafted:
            if self.correction is not None:
                # what the model said of this round's length, from the features it was
                # planned on (the token rule may have cut it short of the planned gamma)
                rate = float(self.model.rates(self.feats, np.array([n_drafted]))[0])
                self.correction.observe(rate * n_drafted, n_accept)
            self.feats = round_stats(list(o.top1[:n_drafted]), list(o.entropy[:n_drafted]),
                                     n_accept) + [self.bpw]
        elif self.correction is not None:
            self.correction.plain_step()
        super().update(o)


class SpecKVObjective(_RoundModelPolicy):
    """SpecKV: the gamma maximising predicted tokens per step, rate * gamma + 1."""

    name = "speckv"

    def choose(self) -> int:
        rates = self._rates()
        return int(self.gammas[np.argmax(rates * self.gammas + 1)])


class Prices:
    """A cost-aware policy's prices: the machine's table read at the cache's current length
    whenever it crosses a multiple of ``CONTEXT_STEP`` tokens, its verification batches
    priced at what they really cost here and now where a ``cost.VerifyScale`` is given
    (``use_scale``). ``costs`` is the CostModel the policy decides with; ``on_read`` derives
    what the policy needs from it each time it changes. ``g_max``: the longest draft."""

    def __init__(self, costs: CostModel | CostTable, g_max: int,
                 on_read: Callable[[CostModel], None]):
        self.table, self.g_max, self.on_read = as_table(costs), g_max, on_read
        self.plan_is_plain = not self.table.drafting_can_pay(g_max)
        self.verify_scale = None
        self._bucket = None
        self.base = self.table.points[0]   # the table at this context, before any scale
        self._scaled_by = (1.0, 1.0)
        self._read(self.base)

    def use_scale(self, scale) -> None:
        """Price verification with ``scale`` (the one the context drafter shares, kept with
        the pair), which the policy's own verified batches teach too. Whether model drafting
        can pay at all is judged at the scaled prices: the table is one sample of a ratio
        that drifts by 10-30% on a shared VM (docs/draft-length.md)."""
        self.verify_scale = scale
        self.plan_is_plain = not any(scale.apply(p).drafting_can_pay(self.g_max)
                                     for p in self.table.points)
        self._rescale()

    def _read(self, costs: CostModel) -> None:
        self.costs = costs
        self.can_pay = costs.drafting_can_pay(self.g_max)
        self.on_read(costs)

    def _rescale(self) -> None:
        """Read the table point at this context again where the scale's factors moved."""
        f = self.verify_scale.factors() if self.verify_scale is not None else (1.0, 1.0)
        if f != self._scaled_by:
            self._scaled_by = f
            self._read(self.base if self.verify_scale is None
                       else self.verify_scale.apply(self.base))

    def at_context(self, n_tokens: int) -> bool:
        """Read the table at ``n_tokens`` of cache; whether its point (the plain token's
        price) changed."""
        bucket = n_tokens // CONTEXT_STEP
        moved = bucket != self._bucket and len(self.table.points) > 1
        if moved:
            self._bucket = bucket
            self.base = self.table.at(n_tokens)
            self._scaled_by = None   # read again below, scaled or not
        self._rescale()
        return moved

    def verified(self, n_rows: int, seconds: float) -> None:
        """A full-depth target batch of ``n_rows`` (1: a plain step) took ``seconds`` at
        this context: what the scale learns from."""
        if self.verify_scale is not None:
            self.verify_scale.observe(self.base, n_rows, seconds)


class TokenRule:
    """The per-token stop rule of the cost-aware policies: after each drafted token, keep it
    while the round's expected tokens per second still rise, using the token model's
    acceptance probability for it (the draft's own top-1 probability and entropy at that
    token, the best single predictor of whether the target will agree).

    Keeping token i adds P(tokens 0..i all accepted) expected tokens for one more verified
    position; drafting token i+1 adds its draft cost as well, and is only tried if the
    optimistic estimate (same acceptance as token i) still pays."""

    def __init__(self, model: AcceptanceModel, bpw: float):
        self.model, self.bpw = model, bpw

    def start(self, costs: CostModel) -> None:
        self._tokens, self._time, self._p_all = 1.0, costs.plain, 1.0
        self._time += costs.draft(1)   # the first drafted token is paid for

    def keep(self, costs: CostModel, i: int, top1: float, entropy: float,
             force: bool = False) -> bool:
        """Keep drafted token i? ``force``: keep it whatever it promises (the totals that
        more() reads count it all the same)."""
        v = costs.verify
        p = self.model.token_p(top1, entropy, i, self.bpw)
        p_all = self._p_all * p
        dv = v(i + 2) - v(i + 1)
        # the draft cost of token i is spent either way: compare with and without it
        if not force and (self._tokens + p_all) / (self._time + dv) <= self._tokens / self._time:
            return False
        self._tokens, self._time, self._p_all = self._tokens + p_all, self._time + dv, p_all
        self._p_next = p_all * p   # optimistic: the next token as likely as this one
        return True

    def more(self, costs: CostModel, i: int) -> bool:
        v, c = costs.verify, costs.draft_token_s
        cost = c + v(i + 3) - v(i + 2)
        if (self._tokens + self._p_next) / (self._time + cost) <= self._tokens / self._time:
            return False
        self._time += c
        return True


class CostAware:
    """What the two cost-aware policies share, each holding its `Prices` and `TokenRule`:
    the guard against the speeds drafting really reaches, and the hooks that read, rescale
    and teach the prices. Not a policy itself (``CostAwareGamma``, ``CostAwareStop``)."""

    prices: Prices
    rule: TokenRule

    def _price(self, costs: CostModel | CostTable, g_max: int, model: AcceptanceModel,
               bpw: float) -> None:
        self.prices = Prices(costs, g_max, self._derive)
        self.rule = TokenRule(model, bpw)
        self.guard = Guard(1.0 / self.costs.plain, memory=MODEL_GUARD_MEMORY)

    def _derive(self, costs: CostModel) -> None:
        """What the policy derives from the costs it decides with (nothing by default)."""

    @property
    def costs(self) -> CostModel:
        return self.prices.costs

    @property
    def can_pay(self) -> bool:
        return self.prices.can_pay

    @property
    def plan_is_plain(self) -> bool:
        return self.prices.plan_is_plain

    @property
    def verify_scale(self):
        return self.prices.verify_scale

    def use_scale(self, scale) -> None:
        self.prices.use_scale(scale)

    @property
    def _one_draft_decode_s(self) -> float:
        return self.costs.draft_token_s

    def _at(self, at: RoundAt) -> None:
        DraftPolicy._at(self, at)
        if self.prices.at_context(at.n_tokens):
            self.guard.plain_prior = 1.0 / self.prices.base.plain

    def update(self, o: Outcome) -> None:
        super().update(o)
        if o.verify_rows:
            self.prices.verified(o.verify_rows, o.verify_s)

    def more(self, i: int) -> bool:
        return self.rule.more(self.costs, i)


class CostAwareGamma(CostAware, _RoundModelPolicy):
    """Ours: whether to draft this round, and at most how many, from the round model: the
    gamma (0 included) maximising expected tokens per second,
    (1 + rate(g) * g) / (g * draft_cost + verify_cost(g + 1)); then, token by token, the
    stop rule cuts the draft where its own confidence says the rest will not pay.

    The round model alone drafts its whole gamma however unsure the draft is of each token
    (48% accepted on HumanEval on the AMX Xeon, 0.948x plain, where the per-token rule alone
    reached 67%, 1.081x); the per-token rule alone pays a draft token every round to learn
    that it is not worth keeping. Together the round model skips rounds predicted to lose
    and the token rule keeps each drafted round to what its tokens promise.

    A plain step teaches nothing about the draft, so after ``explore_every`` plain steps one
    drafted round (its first token kept) refreshes the statistics, but only where some gamma
    could beat plain at all (acceptance 1 at the cost model's prices); with the default pair
    on a CPU whose verification is steep none can at Q4_K_M, so it never drafts and costs
    nothing. Where the models promise a gain, a :class:`Guard` checks it against the speeds
    actually reached.
    """

    name = "ours-gamma"

    def __init__(self, model: AcceptanceModel, costs: CostModel | CostTable, bpw: float,
                 gammas=range(1, MAX_GAMMA + 1), explore_every: int = EXPLORE_EVERY):
        super().__init__(model, bpw, gammas)
        self.correction = Correction()
        self.explore_every = explore_every
        self.n_plain = 0
        self._price(costs, int(self.gammas.max()), model, bpw)

    def _derive(self, costs: CostModel) -> None:
        self.time = np.array([costs.draft(k) + costs.verify(k + 1) for k in self.gammas])
        self.plain_tps = 1.0 / costs.plain

    def _tps(self) -> np.ndarray:
        rates = self._rates()
        if self.correction is not None:
            rates = self.correction.apply(rates)
        return (1.0 + rates * self.gammas) / self.time

    def predicted_tps(self) -> float:
        if not self.can_pay or self.guard.wait > 0:
            return 0.0
        best = float(self._tps().max())
        # a round the catch-up forbids is no rival for a free draft
        return best if self._catch_up_pays(best) else 0.0

    def choose(self) -> int:
        self._exploring = False
        # the guard's wait counts every step, not only those the round model would draft:
        # counted the other way, a wait outlived the rounds that a losing guard declines
        # (a long catch-up, below) and held drafting back for good
        if not self.can_pay or self.guard.hold():
            return 0
        tps = self._tps()
        best = int(np.argmax(tps))
        if tps[best] > self.plain_tps and self._catch_up_pays(float(tps[best])):
            self.n_plain = 0
            g = int(self.gammas[best])
        else:
            self.n_plain += 1
            if self.n_plain < self.explore_every:
                return 0
            # explore: a round as the token rule drafts it, its first token kept whatever
            # it promises. A forced single token taught the round model one token's
            # statistics, often an unsure one, which kept it predicting a loss: HumanEval on
            # the AMX Xeon sat at plain for 16 steps at a time where the draft's rounds were
            # 93% accepted
            self.n_plain = 0
            if not self._exploring_can_pay():
                return 0
            g = int(self.gammas.max())
            self._exploring = True
        self.rule.start(self.costs)
        return g

    def _exploring_can_pay(self) -> bool:
        """Whether an exploring round is worth its price. It first catches the draft up on
        the ``behind`` tokens emitted by plain steps (a batch worth ~3 plain steps after 16
        on the AVX2-only EPYC, where it cost spec-auto ~4% over 64-token answers that never
        drafted again), then risks one rejected token. Its lesson can at best make every
        token left (``room``, at most ``EXPLORE_HORIZON``) as cheap as the fastest round
        with all its drafts accepted; explore only where that saving exceeds the price."""
        if self._losing_far_behind():
            return False
        c = self.costs
        # a round's first draft decode is paid anyway; the catch-up replaces it when longer
        price = c.draft(1) + self._catch_up_extra_s() + c.verify(2) - c.plain
        saving = c.plain - float(np.min(self.time / (self.gammas + 1)))
        return self._horizon() * saving > price

    def _catch_up_extra_s(self) -> float:
        """Seconds that bringing the draft up to date on the ``behind`` tokens (one batch)
        costs beyond a round's own first draft decode, which it replaces. The batch is
        priced as one draft decode plus a per-token price: the guard's, learned from earlier
        catch-ups, else half a draft decode (more than measured: 9.5 ms a token beside a 28
        ms decode on the EPYC; 0.2 of one on the Ice Lake Xeon). Learned from one size it
        serves all: a long batch, cheaper per token, makes a short one look a little cheap."""
        c = self.costs
        rel = self.guard.catch_up_rel
        per = rel * c.plain if rel is not None else c.draft_token_s / 2
        return max(c.draft_token_s + per * self.behind - c.draft(1), 0.0)

    def _horizon(self) -> int:
        """The tokens left to win back a price over: ``room``, at most EXPLORE_HORIZON."""
        return EXPLORE_HORIZON if self.room is None else min(self.room, EXPLORE_HORIZON)

    def reads_prompt(self, at: RoundAt) -> bool:
        """The prompt is read up front only where the caller's limit leaves room to win it
        back: the rounds the round model predicts from its prior must save, over ``room``
        tokens, more than the read costs beyond a round's own first draft decode (priced as
        a catch-up). Before anything was drafted the answer's length is unknown and its
        limit is the only bound, so the check takes the whole limit (not EXPLORE_HORIZON):
        with a chat's long limit it reads every prompt; what it declines is a long prompt
        under a short limit (RAG and summarization answers of a few dozen tokens, where the
        read costs more than the handful of model rounds after it save). The first read (no
        catch-up seen yet) goes ahead where some drafted round is predicted to beat plain: it
        teaches the guard the price; where none is, there is nothing to learn it for."""
        if not super().reads_prompt(at):
            return False
        if self.guard.catch_up_rel is None:
            return at.room is None or float(self._tps().max()) > self.plain_tps
        if at.room is None:
            return True
        return self._catch_up_pays(float(self._tps().max()), horizon=at.room, start=True)

    def _losing_far_behind(self) -> bool:
        """Whether the guard's last verdict went against drafting (no drafted round since)
        and the draft is far behind: a probe would first pay a long catch-up, mid-answer.
        Such probes lost on the Ice Lake Xeon (Spec-Bench dev first turns, 64 tokens): a
        generation that began while the guard waited left its prompt unread, and the first
        round after the wait read it at 5-7 plain steps (3.5-4 more than a round in step),
        in translation answers of 7-32 tokens (12 prompts: 4 such rounds; 3 more caught up
        on the wait's own steps at ~1 step more each), then drafted at the ~60% acceptance
        that had lost before. A losing guard probes again where a generation
        starts: the prompt read up front (``reads_prompt``) and the rounds after it in step.
        """
        return self.guard.losing and self.behind > ROUND_CATCH_UP

    def _catch_up_pays(self, tps: float, horizon: int | None = None,
                       start: bool = False) -> bool:
        """Whether rounds at ``tps`` (predicted) win back what catching the draft up costs
        beyond a round's own first draft decode, over ``horizon`` tokens (default: the tokens
        left, ``_horizon``). Only a draft far behind (plain steps, free drafts, a prompt it
        did not read up front) has a price to weigh: on the Ice
        Lake Xeon a first model round that read a summarization prompt of ~250 tokens cost
        ~15 plain tokens, a quarter of a 64-token answer, and the two rounds after it
        could not win that back (first turns 0.76-0.86x plain there). ``start``: the
        prompt's read as a generation starts, where a losing guard probes again."""
        if self.behind <= ROUND_CATCH_UP:
            return True
        if not start and self._losing_far_behind():
            return False
        saving = self.costs.plain - 1.0 / tps
        horizon = self._horizon() if horizon is None else horizon
        return horizon * saving > self._catch_up_extra_s()

    def keep(self, i: int, top1: float, entropy: float) -> bool:
        # an exploring round keeps its first token whatever it promises: it is there to
        # refresh the round statistics, which only a drafted token does
        return self.rule.keep(self.costs, i, top1, entropy, force=self._exploring and i == 0)


class CostAwareStop(CostAware, DraftPolicy):
    """Ours, per token only: every round drafts, and the stop rule (:class:`TokenRule`)
    decides how many tokens to keep. A round whose first token is dropped still paid for
    it, which the guard sees."""

    name = "ours-stop"
    needs_confidence = True

    def __init__(self, model: AcceptanceModel, costs: CostModel | CostTable, bpw: float,
                 n_max: int = MAX_GAMMA):
        self.model, self.bpw, self.n_max = model, bpw, n_max
        self._price(costs, n_max, model, bpw)

    def choose(self) -> int:
        if not self.can_pay:
            return 0
        self.rule.start(self.costs)
        return self.guard.gate(self.n_max)

    def keep(self, i: int, top1: float, entropy: float) -> bool:
        return self.rule.keep(self.costs, i, top1, entropy)


POLICY_NAMES = ("auto", "stop", "pmin", "hf", "speckv")
NEEDS_MODEL = ("auto", "stop", "speckv")   # fitted acceptance model
NEEDS_COSTS = ("auto", "stop")             # this machine's cost model


def make_policy(name: int | str, *, model: AcceptanceModel | None = None,
                costs: CostModel | None = None, bpw: float = 0.0) -> DraftPolicy:
    """A policy: an integer (fixed gamma) or a name: pmin, hf, speckv, auto (ours:
    cost-aware gamma) or stop (ours: cost-aware per-token stop rule)."""
    if isinstance(name, int):
        return FixedGamma(name)
    if name == "pmin":
        return PMinRule()
    if name == "hf":
        return HFHeuristic()
    needs = {"speckv": (model,), "auto": (model, costs), "stop": (model, costs)}
    if name not in needs:
        raise SpeceeError(f"unknown draft-length policy {name!r}; use a number, pmin, hf, "
                          f"speckv, auto or stop")
    if any(x is None for x in needs[name]):
        raise SpeceeError(f"policy {name} needs a fitted controller"
                          + (" and a cost model" if name != "speckv" else ""))
    if name == "speckv":
        return SpecKVObjective(model, bpw)
    if name == "auto":
        return CostAwareGamma(model, costs, bpw)
    return CostAwareStop(model, costs, bpw)

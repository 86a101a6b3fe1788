"""Per-machine cost model for speculative decoding, measured once per model pair and cached.

Target: seconds to decode a batch of n tokens (n = 1..16) at the current context, as the
verification of n-1 drafted tokens costs; draft: seconds per drafted token. With per-token
acceptance a, draft length g, draft cost c and verification cost v(g+1), the expected speed
in tokens per second of one round is

    E[tokens] / time = ((1 - a^(g+1)) / (1 - a)) / (draft(g) + v(g + 1))

and g = 0 is plain decoding (1 / the plain token time). On a 2-core CPU v grows fast with n,
so short drafts (often none) win; on a GPU v is nearly flat and longer drafts pay.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..config import (COST_CONTEXTS, LONG_BATCHES, MAX_GAMMA, MAX_VERIFY, NEAR_MARGIN,
                      PLAUSIBLE_DIP, SCALE_CLIP, SCALE_PRIOR, SCALE_WINDOW, STEADY_RUNS)
from ..engine.timing import run_steps
from ..paths import home, write_text_atomic

N_MAX = MAX_VERIFY


@dataclass(frozen=True)
class CostModel:
    # index n-1: seconds for a target batch of n tokens, right after n-1 draft decodes (as a
    # speculative round runs it: the models alternate on the same cores and memory)
    target_batch_s: list[float]
    draft_token_s: float          # seconds per draft decode, between target batches
    key: str = ""
    plain_token_s: float = 0.0    # seconds per token of plain decoding (0: target_batch_s[0])
    # a round's first draft decode also takes in what the draft has not seen yet: usually
    # the last accepted draft token and the target's token, a batch of 2 (0: draft_token_s)
    draft_first_s: float = 0.0
    machine: dict = field(default_factory=dict)  # provenance.machine(): where this was measured
    context: int = 0              # tokens in the cache when measured (0: unknown)
    # longer target batches (free drafts from the context): their sizes and seconds
    long_sizes: list[int] = field(default_factory=list)
    long_batch_s: list[float] = field(default_factory=list)

    @property
    def plain(self) -> float:
        return self.plain_token_s or self.target_batch_s[0]

    def draft(self, g: int) -> float:
        """Seconds to draft g tokens in a round."""
        if g <= 0:
            return 0.0
        return (self.draft_first_s or self.draft_token_s) + (g - 1) * self.draft_token_s

    def verify(self, n: int) -> float:
        """Seconds for a target batch of n tokens; past the table, its mean cost per added
        token beyond the first (the last two entries alone can slope down: a batch of 16
        fills the CPU kernels' 4- and 8-row tiles and measured cheaper than one of 15, and
        a draft one past the table then looked cheaper still)."""
        t = self.target_batch_s
        if n <= len(t):
            return t[n - 1]
        return float(self.verify_curve(n)[-1])

    def verify_curve(self, n_max: int) -> np.ndarray:
        """verify(n) for n = 1..n_max (index n - 1) in one array: between measured longer
        batches linear, past the last one its slope (a free draft's best length is chosen
        over up to 63 of them every round)."""
        t = self.target_batch_s
        xs = np.array(list(range(1, len(t) + 1)) + list(self.long_sizes), dtype=np.float64)
        ys = np.array(list(t) + list(self.long_batch_s), dtype=np.float64)
        n = np.arange(1, n_max + 1, dtype=np.float64)
        out = np.interp(n, xs, ys)
        if self.long_sizes:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        else:
            slope = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else t[-1]
        past = n > xs[-1]
        out[past] = ys[-1] + max(slope, 0.0) * (n[past] - xs[-1])
        return out

    def expected_tps(self, accept: float, gamma: int) -> float:
        """Expected tokens per second of draft length gamma at per-token acceptance accept."""
        if gamma == 0:
            return 1.0 / self.plain
        a = min(max(accept, 0.0), 1.0 - 1e-9)
        tokens = (1.0 - a ** (gamma + 1)) / (1.0 - a)
        return tokens / (self.draft(gamma) + self.verify(gamma + 1))

    def scaled(self, short: float, long: float | None = None) -> CostModel:
        """These costs with every target batch of 2 to MAX_VERIFY rows multiplied by
        ``short`` and every longer one by ``long`` (``short`` where None); the plain token,
        the unit the policies compare against, and the draft kept."""
        long = short if long is None else long
        t = self.target_batch_s
        return replace(self, plain_token_s=self.plain,
                       target_batch_s=[t[0]] + [x * short for x in t[1:]],
                       long_batch_s=[x * (short if n <= MAX_VERIFY else long)
                                     for n, x in zip(self.long_sizes, self.long_batch_s)])

    def drafting_can_pay(self, g_max: int) -> bool:
        """Whether some draft length up to g_max beats plain decoding even with every
        drafted token accepted; if not, a cost-aware policy never drafts."""
        return any((g + 1) / (self.draft(g) + self.verify(g + 1)) > 1.0 / self.plain
                   for g in range(1, g_max + 1))

    def best_gamma(self, accept: float, gammas=range(0, MAX_GAMMA + 1)) -> int:
        return max(gammas, key=lambda g: self.expected_tps(accept, g))

    # What would make drafting pay where it does not: the answer a cost table owes when a
    # goal is out of reach on a machine, in the units the table is read in.

    def paying_draft_cost(self, accept: float, g_max: int = MAX_GAMMA) -> float:
        """The dearest draft token, as a fraction of a plain token, with which some draft
        length up to ``g_max`` would beat plain decoding at per-token acceptance ``accept``
        (this table's verification; a round's first draft decode kept at its measured ratio
        to the others). At most 0: verification alone loses at this acceptance, and no
        draft, however cheap, pays."""
        a = min(max(accept, 0.0), 1.0 - 1e-9)
        first = self.draft_first_s / self.draft_token_s \
            if self.draft_first_s and self.draft_token_s else 1.0
        best = -np.inf
        for g in range(1, g_max + 1):
            tokens = (1.0 - a ** (g + 1)) / (1.0 - a)
            # tokens / (c (first + g - 1) + v(g + 1)) > 1 / plain, solved for c
            best = max(best, (tokens * self.plain - self.verify(g + 1)) / (first + g - 1))
        return float(best / self.plain)

    def paying_acceptance(self, g_max: int = MAX_GAMMA) -> float | None:
        """The lowest per-token acceptance from which this draft (its measured cost) beats
        plain decoding at some draft length up to ``g_max``; None where none does, even with
        every drafted token accepted."""
        if not self.drafting_can_pay(g_max):
            return None

        def pays(a: float) -> bool:
            return max(self.expected_tps(a, g) for g in range(1, g_max + 1)) > 1.0 / self.plain

        lo, hi = 0.0, 1.0   # pays(hi) holds in the limit (drafting_can_pay)
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        return hi


@dataclass(frozen=True)
class CostTable:
    """Cost models measured at several context lengths: a token costs more with a longer
    cache (attention reads it), so the policies read the costs at the current length."""

    points: list[CostModel]       # by increasing context
    key: str = ""
    machine: dict = field(default_factory=dict)
    # the draft's flash attention the points were measured with (engine/draft_attention.py,
    # which keeps the setting the draft runs with): None for llama.cpp's default, False
    # where off made the draft's tokens cheaper
    draft_flash_attn: bool | None = None
    draft_attention: dict = field(default_factory=dict)   # what time_attention saw

    def at(self, n_context: int) -> CostModel:
        """Costs at ``n_context`` cached tokens: linear between the measured contexts, the
        nearest one outside them."""
        pts = self.points
        if n_context <= pts[0].context or len(pts) == 1:
            return pts[0]
        if n_context >= pts[-1].context:
            return pts[-1]
        j = next(i for i, p in enumerate(pts) if p.context >= n_context)
        a, b = pts[j - 1], pts[j]
        w = (n_context - a.context) / (b.context - a.context)

        def mix(x: float, y: float) -> float:
            return x + w * (y - x)

        same_long = a.long_sizes == b.long_sizes

        return CostModel(target_batch_s=[mix(x, y) for x, y in zip(a.target_batch_s,
                                                                    b.target_batch_s)],
                         draft_token_s=mix(a.draft_token_s, b.draft_token_s), key=self.key,
                         plain_token_s=mix(a.plain, b.plain),
                         draft_first_s=mix(a.draft_first_s, b.draft_first_s),
                         machine=self.machine, context=n_context,
                         # longer batches only where both points measured the same sizes
                         long_sizes=list(a.long_sizes) if same_long else [],
                         long_batch_s=[mix(x, y) for x, y in zip(a.long_batch_s,
                                                                 b.long_batch_s)]
                         if same_long else [])

    def drafting_can_pay(self, g_max: int) -> bool:
        return any(p.drafting_can_pay(g_max) for p in self.points)

    def scaled(self, short: float, long: float | None = None) -> CostTable:
        """Every point's batches scaled (``CostModel.scaled``): what a replay times its
        rounds with where real verification runs dearer than the table."""
        return replace(self, points=[p.scaled(short, long) for p in self.points])


class VerifyScale:
    """What a verification batch really costs here and now against the cost table, learned
    from the rounds themselves. The table is measured once per machine, in a tight loop; on
    the 2-core EPYC with AVX2 only the context drafts of HumanEval answers were verified at
    2.05/2.32/4.30 plain steps for 2/3/7 drafted tokens where the table said 1.84/2.14/3.65,
    and such a table ratio moves 10-30% from one measurement to the next on a shared VM.

    It keeps decayed means of log(real / table) for plain steps and for verification batches
    (short: up to MAX_VERIFY rows, long: more), each at the context it ran at, and scales the
    table's batches by exp(batch mean - plain mean): a machine slower all round (both
    alike) keeps its table, one whose batches grew dearer than its single tokens pays more for
    them. Each mean is shrunk towards the level of all the steps seen, plain and batches
    alike, as if ``prior`` observations had run at it, and each ratio clipped to [1/2, 2]
    (one step that met a neighbour's burst moves it little).
    It belongs to the machine, not the prompt: kept with the loaded pair, and shared by the
    context drafter and the draft model's cost-aware policy (each prices its rounds with it
    and teaches it with the batches it verified)."""

    def __init__(self, prior: float = SCALE_PRIOR, window: int = SCALE_WINDOW):
        self.prior, self.keep = prior, 1.0 - 1.0 / window
        self._sum = {"plain": 0.0, "short": 0.0, "long": 0.0}   # decayed sums of log ratios
        self._n = {"plain": 0.0, "short": 0.0, "long": 0.0}     # and of their weights
        self._applied: tuple | None = None   # (the costs, their factors, the scaled copy)

    @staticmethod
    def _kind(n_rows: int) -> str:
        return "plain" if n_rows <= 1 else "short" if n_rows <= MAX_VERIFY else "long"

    def observe(self, costs: CostModel, n_rows: int, seconds: float) -> None:
        """A target batch of ``n_rows`` (1: a plain step) took ``seconds`` where ``costs``
        (the table at that context) say ``costs.verify(n_rows)``."""
        if seconds <= 0:
            return
        ratio = min(max(seconds / costs.verify(n_rows), SCALE_CLIP[0]), SCALE_CLIP[1])
        k = self._kind(n_rows)
        self._sum[k] = self.keep * self._sum[k] + float(np.log(ratio))
        self._n[k] = self.keep * self._n[k] + 1.0

    def _mean(self, kind: str, towards: float = 0.0) -> float:
        return (self._sum[kind] + self.prior * towards) / (self._n[kind] + self.prior)

    def factor(self, n_rows: int) -> float:
        """What the table's batch of ``n_rows`` is multiplied by (1 for a plain step)."""
        k = self._kind(n_rows)
        if k == "plain":
            return 1.0
        # both means are shrunk towards the level of all the steps seen (the machine as
        # fast or slow as they show, round after round alike): with plain steps alone seen,
        # say by a policy that never drafted, batches keep the table's price in plain steps
        # (shrunk towards 0 instead, a machine 30% slow in its plain steps priced its
        # batches ~20% cheaper before it had verified one)
        n = self._n["plain"] + self._n[k]
        level = (self._sum["plain"] + self._sum[k]) / n if n > 0 else 0.0
        return float(np.exp(self._mean(k, towards=level) - self._mean("plain", towards=level)))

    def factors(self) -> tuple[float, float]:
        """The factors of short and long batches, rounded to 0.1%: what ``apply`` uses."""
        return round(self.factor(2), 3), round(self.factor(MAX_VERIFY + 1), 3)

    def apply(self, costs: CostModel) -> CostModel:
        """``costs`` with every batch of 2+ rows scaled by its factor (the plain token kept:
        the unit the policies compare against). The same costs and factors give the same
        copy back, as the drafter asks every round."""
        f = self.factors()
        if self._applied is not None and self._applied[0] is costs and self._applied[1] == f:
            return self._applied[2]
        scaled = costs if f == (1.0, 1.0) else costs.scaled(*f)
        self._applied = (costs, f, scaled)
        return scaled


def as_table(costs: CostModel | CostTable) -> CostTable:
    if isinstance(costs, CostTable):
        return costs
    return CostTable([costs], key=costs.key, machine=costs.machine)


def cache_path(key: str) -> Path:
    return home() / "costs" / f"{key}.json"


def load_cached(key: str) -> CostTable | None:
    """The cached table for ``key`` (model files, machine, method); None where there is none
    (or a torn one, or another layout of the file: measured again)."""
    try:
        data = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    names = {f.name for f in fields(CostModel)}
    if isinstance(data, dict) and isinstance(data.get("points"), list) and data["points"] \
            and all(isinstance(p, dict) and set(p) <= names
                    and {"target_batch_s", "draft_token_s"} <= set(p) for p in data["points"]):
        fa = data.get("draft_flash_attn")
        return CostTable([CostModel(**p) for p in data["points"]], key=data.get("key", key),
                         machine=data.get("machine", {}),
                         draft_flash_attn=fa if isinstance(fa, bool) else None,
                         draft_attention=data.get("draft_attention") or {})
    return None


def with_key(key: str, table) -> CostTable:
    """``table`` (a CostModel or CostTable) as the table of ``key``, its points too."""
    table = as_table(table)
    return replace(table, key=key, points=[replace(p, key=key) for p in table.points])


def store(key: str, table) -> CostTable:
    """Cache ``table`` (a CostModel or CostTable) under ``key``; returns it as a table."""
    table = with_key(key, table)
    write_text_atomic(cache_path(key), json.dumps(asdict(table)))
    return table


def load_or_measure(key: str, measure, keep: Callable[[CostTable], bool] | None = None
                    ) -> CostTable:
    """The cached table for ``key`` (model files, machine, method), measured on first use;
    cached only where ``keep`` (if given) says so, else returned for this run alone."""
    table = load_cached(key)
    if table is not None:
        return table
    table = with_key(key, measure())
    return store(key, table) if keep is None or keep(table) else table


def implausible(table: CostModel | CostTable) -> str | None:
    """Why ``table`` cannot be what this machine's batches cost (None: it can be): some
    batch measured under PLAUSIBLE_DIP of a smaller batch (a plain token is a batch of 1)."""
    for p in as_table(table).points:
        sizes = list(range(1, len(p.target_batch_s) + 1)) + list(p.long_sizes)
        ratios = [s / p.plain for s in list(p.target_batch_s) + list(p.long_batch_s)]
        for j in range(1, len(ratios)):
            i = int(np.argmax(ratios[:j]))
            if ratios[j] < PLAUSIBLE_DIP * ratios[i]:
                return (f"at {p.context} tokens of context a batch of {sizes[j]} measured "
                        f"{ratios[j]:.2f} plain tokens, a batch of {sizes[i]} {ratios[i]:.2f}")
    return None


MEASURE_VERSION = 12  # part of the cache key: a changed method measures again (7: long
# batches; 8: each sample against a plain token timed just before it; 9: the draft's flash
# attention chosen first, the draft measured with it; 10: a draft token read as greedy rounds
# read it, its token and confidence in C, not a copy of its logits; 11: so are the draft
# variants screened, speculative/variants.py; 12: a table disturbed while it measured
# (``implausible``) is measured again, and not kept if it stays so)


def long_sizes(tgt_seq) -> list[int]:
    """The longer target batches measured for free drafts: those that fit one batch of the
    context (``n_batch``) and leave room in its cache."""
    ctx = tgt_seq.ctx
    return [n for n in LONG_BATCHES if n <= ctx.n_batch and n < ctx.n_ctx // 4]


def measure_table(tgt_seq, dft_seq, tokens: list[int], contexts=COST_CONTEXTS,
                  repeats: int = 5, progress: Callable[[str], Any] | None = None
                  ) -> CostTable:
    """:func:`measure` at each context the caches can hold (fewer in a small context);
    ``progress`` is told where it is (a first chat turn waits for all of it: 1 min 45 s
    with the default pair on the 2-core EPYC)."""
    state: dict = {}
    run_steps(measure_table_steps(tgt_seq, dft_seq, tokens, state, contexts, repeats, progress))
    return table_from(state)


def measure_table_steps(tgt_seq, dft_seq, tokens: list[int], state: dict,
                        contexts=COST_CONTEXTS, repeats: int = 5,
                        progress: Callable[[str], Any] | None = None,
                        clock=time.perf_counter) -> Iterator[str]:
    """:func:`measure_table` one timed sample at a time: yields after each (saying what
    it measured) with everything taken so far in ``state`` (JSON-ready). Given the state of
    a stopped measurement it takes only the samples still missing, so a measurement can run
    in the slices of time where nobody waits on the models and resume in a later process."""
    room = min(tgt_seq.ctx.n_ctx, dft_seq.ctx.n_ctx) - max(N_MAX, *long_sizes(tgt_seq)) - 1
    fits = sorted({min(c, room) for c in contexts})
    points = state.setdefault("points", [{} for _ in fits])
    if len(points) != len(fits):   # another context size: its samples do not apply
        points[:] = [{} for _ in fits]

    def at(i: int, c: int):
        return lambda what: progress(f"context {i + 1}/{len(fits)} ({c} tokens): {what}") \
            if progress is not None else None

    # the longer contexts with fewer repeats: they refine the first
    for i, c in enumerate(fits):
        yield from measure_steps(tgt_seq, dft_seq, tokens, points[i],
                                 repeats if i == 0 else max(1, repeats - 2), n_context=c,
                                 clock=clock, progress=at(i, c))


def table_from(state: dict) -> CostTable:
    """The table of a complete :func:`measure_table_steps` or :func:`steady_table_steps`
    state (the median of its measurements where it took several)."""
    tables = [_first_table(state)] + [table_from(s) for s in state.get("again", [])]
    return tables[0] if len(tables) == 1 else median_table(tables)


def _first_table(state: dict) -> CostTable:
    """The table of a state's first (or only) measurement."""
    return CostTable([model_from(p) for p in state["points"]])


def median_table(tables: list[CostTable]) -> CostTable:
    """Each price the median of its readings in ``tables`` (measurements of one pair at the
    same contexts)."""
    def med(values):
        return float(np.median(values))

    points = []
    for ps in zip(*(t.points for t in tables)):
        p = ps[0]
        points.append(replace(
            p, target_batch_s=[med(v) for v in zip(*(q.target_batch_s for q in ps))],
            draft_token_s=med([q.draft_token_s for q in ps]),
            plain_token_s=med([q.plain_token_s for q in ps]),
            draft_first_s=med([q.draft_first_s for q in ps]),
            long_batch_s=[med(v) for v in zip(*(q.long_batch_s for q in ps))]))
    return replace(tables[0], points=points)


def steady_table_steps(tgt_seq, dft_seq, tokens: list[int], state: dict,
                       verdict: Callable[[CostTable], float], near: float = NEAR_MARGIN,
                       runs: int = STEADY_RUNS, repeats: int = 5,
                       progress: Callable[[str], Any] | None = None,
                       clock=time.perf_counter) -> Iterator[str]:
    """:func:`measure_table_steps`, and where ``verdict`` of the table (1.0 its threshold)
    lies within ``near`` of 1, or the table is :func:`implausible`, ``runs`` - 1 more
    measurements of it (kept in ``state["again"]``), so that :func:`table_from` takes the
    median of them all: two measurements on one machine come to the same verdict, and one
    disturbed measurement does not make the table."""
    yield from measure_table_steps(tgt_seq, dft_seq, tokens, state, repeats=repeats,
                                   progress=progress, clock=clock)
    first = _first_table(state)
    disturbed = implausible(first) is not None
    if not disturbed and abs(verdict(first) - 1.0) >= near:
        return
    why = "the first was disturbed" if disturbed else "the verdict is near its threshold"
    again = state.setdefault("again", [{} for _ in range(runs - 1)])
    for i, s in enumerate(again):
        say = (lambda what, i=i: progress(f"{what} (measurement {i + 2} of {runs}: {why})")) \
            if progress is not None else None
        yield from measure_table_steps(tgt_seq, dft_seq, tokens, s, repeats=repeats,
                                       progress=say, clock=clock)


def measure(tgt_seq, dft_seq, tokens: list[int], repeats: int = 5,
            n_context: int = COST_CONTEXTS[0], clock=time.perf_counter,
            progress: Callable[[str], Any] | None = None) -> CostModel:
    """Time what decoding does, after ``n_context`` cached tokens (``tokens`` repeated):
    plain steps (single target decodes in a row, before the draft has run at all), and
    speculative rounds: a 2-token draft catch-up decode, more single draft decodes, then a
    target batch of n, for n = 1..N_MAX. Timing them interleaved as rounds run them, not
    each model alone, matters on a small CPU: measured alone, the draft looked ~30% cheaper
    than in real rounds (not a thread-pool effect: under OpenMP both contexts share one
    team).

    Every timed sample is paired with a plain target token timed just before it, and the
    table keeps the median of each sample's ratio to its own reference, scaled by the median
    plain token: the policies read costs as multiples of a plain token, and a machine that
    slows down while it measures (a laptop warming up, a neighbour starting) slows both.
    Timing the plain tokens first and the batches after would put such a drift into every
    ratio. What this does not remove: on a shared 2-core VM the ratios themselves move
    10-30% from one measurement to the next, plain tokens (memory bound) and batches
    (compute bound) being slowed by different neighbours.
    Medians of ``repeats`` after an untimed warm-up; both caches are left holding ``tokens``."""
    state: dict = {}
    run_steps(measure_steps(tgt_seq, dft_seq, tokens, state, repeats, n_context, clock,
                            progress))
    return model_from(state)


def measure_steps(tgt_seq, dft_seq, tokens: list[int], state: dict, repeats: int = 5,
                  n_context: int = COST_CONTEXTS[0], clock=time.perf_counter,
                  progress: Callable[[str], Any] | None = None,
                  sizes: tuple[int, ...] | None = None,
                  longs: list[int] | None = None) -> Iterator[str]:
    """:func:`measure` one timed sample at a time, its samples kept in ``state`` (see
    :func:`measure_table_steps`); :func:`model_from` makes the CostModel of a complete
    state. Each (re)start warms up and fills the caches untimed; both are left holding
    ``tokens`` when it completes. ``sizes`` (rounds' target batches, default 1..N_MAX) and
    ``longs`` (longer batches, default ``long_sizes``) time fewer sizes, the others read
    between them (an estimate: ``estimate_steps``)."""
    longs = long_sizes(tgt_seq) if longs is None else [n for n in longs
                                                        if n in long_sizes(tgt_seq)]
    biggest = max(N_MAX, *longs)
    n = min(n_context, tgt_seq.ctx.n_ctx - biggest - 1, dft_seq.ctx.n_ctx - N_MAX - 1)
    context = (tokens * (n // max(len(tokens), 1) + 1))[:max(n, len(tokens))]
    filler = (tokens * (biggest // max(len(tokens), 1) + 1))[:biggest]
    state.setdefault("context", len(context))
    state.setdefault("long_sizes", longs)
    refs = state.setdefault("refs", [])      # every plain reference token, for the scale
    plain = state.setdefault("plain", [])
    batch = state.setdefault("batch", {})    # n -> ratios to each sample's own reference
    first = state.setdefault("first", [])
    single = state.setdefault("single", [])
    long_r = state.setdefault("long", {})
    say = progress or (lambda what: None)
    tgt_seq.prefill(context)
    base_t = len(tgt_seq.tokens)
    for k in (1, N_MAX):  # warm-up
        tgt_seq.decode_greedy(filler[:k])   # as greedy verification reads it
        tgt_seq.rewind(base_t)

    def reference() -> float:
        """One plain step (decode, the argmax read in C) at the measured context."""
        t0 = clock()
        tgt_seq.decode([filler[0]])
        tgt_seq.argmax()
        dt = clock() - t0
        tgt_seq.rewind(base_t)
        refs.append(dt)
        return dt

    while len(plain) < repeats:
        t0 = clock()
        for t in filler[:4]:
            tgt_seq.decode([t])   # as greedy plain decoding runs: the argmax read in C
            tgt_seq.argmax()
        plain.append((clock() - t0) / 4)
        tgt_seq.rewind(base_t)
        yield "plain steps"
    dft_seq.prefill(context)
    base_d = len(dft_seq.tokens)
    dft_seq.feed(filler[:2])
    dft_seq.rewind(base_d)
    for k in sizes or range(1, N_MAX + 1):
        runs = batch.setdefault(str(k), [])
        while len(runs) < repeats:
            say(f"rounds drafting {k - 1} of {N_MAX - 1}")
            ref = reference()
            t0 = clock()
            # each draft decode read as a greedy round reads it: token and confidence in C
            if k > 1:
                dft_seq.decode(filler[:2])
                dft_seq.confidence()
            t1 = clock()
            for t in filler[2:k]:
                dft_seq.decode([t])
                dft_seq.confidence()
            t2 = clock()
            tgt_seq.decode_greedy(filler[:k])
            runs.append((clock() - t2) / ref)
            if k > 1:
                first.append((t1 - t0) / ref)
            if k > 2:
                single.append((t2 - t1) / (k - 2) / ref)
            tgt_seq.rewind(base_t)
            dft_seq.rewind(base_d)
            yield f"a round drafting {k - 1}"
    # longer batches (free drafts, no draft decodes before them), fewer repeats: they cost
    # up to ~25 plain tokens each
    for k in longs:
        runs = long_r.setdefault(str(k), [])
        if len(runs) < max(1, (repeats + 1) // 2):
            say(f"a batch of {k} (longer free drafts)")
            tgt_seq.decode_greedy(filler[:k])   # warm-up: its graph shape
            tgt_seq.rewind(base_t)
        while len(runs) < max(1, (repeats + 1) // 2):
            ref = reference()
            t0 = clock()
            tgt_seq.decode_greedy(filler[:k])
            runs.append((clock() - t0) / ref)
            tgt_seq.rewind(base_t)
            yield f"a batch of {k}"
    # the context starts with ``tokens``: leave both caches holding exactly them
    tgt_seq.rewind(len(tokens))
    dft_seq.rewind(len(tokens))


def estimate_steps(tgt_seq, dft_seq, tokens: list[int], state: dict, clock=time.perf_counter,
                   progress: Callable[[str], Any] | None = None) -> Iterator[str]:
    """A first estimate of the table's first point in seconds (7-14 s with the default pair on
    2 cores, where the table takes about 2 minutes): only the sizes that decide whether the
    draft model pays and what free drafts cost (ESTIMATE_SIZES, ESTIMATE_LONG), fewer
    repeats, the rest read between them (``model_from``). Noisier than the table that
    refines it: its verdict is taken only where it lies clearly on one side."""
    from ..config import ESTIMATE_LONG, ESTIMATE_REPEATS, ESTIMATE_SIZES

    yield from measure_steps(tgt_seq, dft_seq, tokens, state, ESTIMATE_REPEATS,
                             n_context=COST_CONTEXTS[0], clock=clock, progress=progress,
                             sizes=ESTIMATE_SIZES, longs=list(ESTIMATE_LONG))


def model_from(state: dict) -> CostModel:
    """The CostModel of a complete :func:`measure_steps` state: each kind's median ratio to
    its reference, scaled by the median of every plain token timed (the references and the
    runs of four)."""
    unit = float(np.median(state["refs"] + state["plain"]))
    longs = state["long_sizes"]
    # sizes an estimate did not time read linearly between those it did (a plain step is
    # 1 by definition where it timed no batch of 1)
    timed = {1: 1.0, **{int(k): float(np.median(v)) for k, v in state["batch"].items()},
             **{k: float(np.median(state["long"][str(k)])) for k in longs}}
    xs = sorted(timed)
    batch = np.interp(np.arange(1, N_MAX + 1), xs, [timed[x] for x in xs])
    return CostModel(target_batch_s=[float(r) * unit for r in batch],
                     draft_token_s=float(np.median(state["single"])) * unit,
                     plain_token_s=unit,
                     draft_first_s=float(np.median(state["first"])) * unit,
                     context=state["context"], long_sizes=longs,
                     long_batch_s=[float(np.median(state["long"][str(k)])) * unit
                                   for k in longs])

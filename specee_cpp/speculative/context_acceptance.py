"""The copy model: the fitted acceptance of free drafts from the context.

Each proposed token of the context drafter (context_drafter.py) is described by ten numbers
(``context_drafter.copy_features``: the trie's share and its support, the length of the suffix it
was matched on, its position in the draft; the hit rate of the trie's first guess over the
recent output and over all of it, its current run of right guesses and how many it made;
where the copy being followed comes from, the prompt or the output, and for the output how
far back);
the model, the mean of COPY_MEMBERS small MLPs of ``mlp.py``, says how likely the target accepts
the token given that the tokens before it were accepted. It replaces the drafter's built-in guess
(share x a per-run Beta posterior starting at 2/3), which is blind to what kind of output
it is in: where verification is dear it never dares to draft, code edits included, and where
verification is cheaper it also drafts chat answers that copy little.

Data without running the target twice: under greedy decoding a free draft's fate is fixed
by the output. Token j of the proposal made before output position t is accepted iff it
equals output t + j and the tokens before it were. Replaying a plain greedy output through
the drafter's own trie gives, at every position, the proposal the drafter would make there,
its features and their labels (``samples``). Replaying the drafter's decisions with a cost
table (``simulate``) gives exactly the rounds and the acceptance that spec decoding would
have on that prompt (lossless: the same output), and the speed those costs predict.
Fitted on dev prompts only (scripts/fit_copy_model.py); one model per target, shipped as
``bundles/<target sha256[:16]>.copy.npz``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..config import COPY_EPOCHS, COPY_MEMBERS, COPY_PER_STREAM
from ..engine.drafts import accept_greedy, draft_room
from ..errors import SpeceeError
from ..mlp import forward_mean, load_npz, save_npz, stack, train_mlp
from ..paths import BUNDLE_DIR
from .cost import VerifyScale, as_table
from .policies import context_guard
from .context_drafter import ContextSource, best_prefix

MODEL_VERSION = 2
FEATURES = ("share", "log1p_support", "match", "position", "recent_hits", "output_hits",
            "log1p_run", "log1p_guesses", "copy_source", "log1p_output_copy_back")
_NAMES = [f"n{i}" for i in range(6)]


def bundle_path(target_sha256: str) -> Path:
    return BUNDLE_DIR / f"{target_sha256[:16]}.copy.npz"


@dataclass
class CopyModel:
    nets: tuple            # one (mu, sigma, W1, b1, W2, b2) per member
    meta: dict = field(default_factory=dict)

    def predict(self, X: np.ndarray) -> np.ndarray:
        p = forward_mean(self._stacked, X)
        scale = self.first_scale
        if scale != 1.0:
            p = np.where(first_guess(X), p * scale, p)
        return p

    @cached_property
    def _stacked(self) -> tuple:
        return stack(list(self.nets))

    @property
    def first_scale(self) -> float:
        """What the nets' acceptance of an answer's first proposed token is multiplied by
        (``first_guess_scale``; 1 for a bundle fitted before it was kept)."""
        return float(self.meta.get("first_scale", 1.0))

    @property
    def copy_break(self) -> float:
        """Per token, how often a followed long copy broke off in the fitting streams
        (``copy_break_rate``; 0 for a bundle fitted before it was kept)."""
        return float(self.meta.get("copy_break", 0.0))

    def save(self, path: Path) -> None:
        save_npz(path, {f"m{k}{n}": a for k, net in enumerate(self.nets)
                        for n, a in zip(_NAMES, net)},
                 dict(self.meta, version=MODEL_VERSION, features=list(FEATURES),
                      members=len(self.nets)))

    @classmethod
    def load(cls, path: Path) -> CopyModel:
        meta, arrays = load_npz(path, None, "copy model")   # one read of the file
        if meta.get("version") != MODEL_VERSION or meta.get("features") != list(FEATURES):
            raise SpeceeError(f"copy model {path} has version {meta.get('version')} and "
                              f"features {meta.get('features')}; this build needs version "
                              f"{MODEL_VERSION}: refit with scripts/fit_copy_model.py")
        k = int(meta.get("members", 0))
        missing = [f"m{m}{n}" for m in range(k) for n in _NAMES if f"m{m}{n}" not in arrays]
        if not k or missing:
            raise SpeceeError(f"not a copy model file: {path} ({k} members, missing "
                              f"{missing[:3]})")
        return cls(tuple(tuple(arrays[f"m{m}{n}"] for n in _NAMES) for m in range(k)), meta)


def _start(prompt: list[int], output: list[int], costs=None, model=None,
           is_eog=None, guard=None, verify_scale=None) -> ContextSource:
    # as generate_spec starts it: the prompt and the first token (from prefill) unscored
    src = ContextSource(costs, model=model, is_eog=is_eog, guard=guard,
                        verify_scale=verify_scale)
    src.extend(list(prompt) + list(output[:1]))
    return src


def samples(prompt: list[int], output: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(features, accepted) of every proposed token the target would judge, at every
    position of a greedy ``output`` (those up to the first rejection)."""
    src = _start(prompt, output)
    X, y = [], []
    for t in range(1, len(output)):
        prop = src.propose()
        if prop.tokens:
            F = src.features(prop)
            for j, tok in enumerate(prop.tokens[:len(output) - t]):
                X.append(F[j])
                y.append(float(tok == output[t + j]))
                if tok != output[t + j]:
                    break
        src.extend([output[t]], emitted=True)
    return np.array(X).reshape(-1, len(FEATURES)), np.array(y)


@dataclass(frozen=True)
class Simulated:
    tokens: int
    seconds: float
    plain_seconds: float
    rounds: int
    drafted: int
    accepted: int

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 1.0


def simulate(prompt: list[int], output: list[int], costs, model: CopyModel | None = None,
             oracle: bool = False, limit: int | None = None, is_eog=None,
             timing=None, as_run=None) -> Simulated:
    """The context drafter deciding as in ``generate_spec`` (free drafts only) on a greedy
    ``output`` (its end-of-generation token last where the answer ended with one: a round
    may draft it): its rounds, drafts and acceptance exactly; its time from ``costs``. With
    ``oracle`` it knows how much of each proposal (the trie's, and the copied stretch's
    continuation) will be accepted and drafts exactly the better one's accepted part where
    it pays: the bound of any acceptance model for this drafter and these costs.
    ``limit``: the output was cut at that many tokens (the run's max_tokens), which, as in
    ``generate_spec``, no draft reaches past; ``is_eog``: the target's end-of-generation
    test, after whose tokens no draft goes on (as the spec mode drafts); ``timing``: the
    table the rounds are timed with (default ``costs``, which the drafter decides with): on
    the 2-core EPYC real batches ran ~20% over the table, and code edits timed so replayed
    at 1.41x of plain, as their bench measured (1.46x), where timed by the table they
    replayed at 1.62x (docs/draft-length.md). ``as_run``: a ``cost.VerifyScale`` (one per
    replay, carried from answer to answer as a loaded pair carries it): the drafter runs as
    ``--mode spec`` builds it, with that scale and a fresh guard of its short drafts, both
    taught by the rounds' timed seconds."""
    guard = context_guard(costs) if as_run is not None else None   # as Spec.start gives it
    src = _start(prompt, output, costs, model, is_eog, guard=guard, verify_scale=as_run)
    clock = src.table if timing is None else as_table(timing)
    t, seconds, plain, rounds, drafted, accepted = 1, 0.0, 0.0, 0, 0, 0
    while t < len(output):
        n_ctx = len(prompt) + t
        c = clock.at(n_ctx)
        # the target's greedy token after drafted prefix i is the output's (none past its end)
        target_at = lambda i: output[t + i] if t + i < len(output) else -1  # noqa: E731
        room = draft_room(limit, t)
        if oracle:
            d, best = [], 1.0 / c.plain
            n = src.follow_max if room is None else min(src.follow_max, room)
            for cand in (src.to_end(src.propose().tokens[:n]), src.copy_continuation(n)):
                a = accept_greedy(cand, target_at)[0]
                g, tps = best_prefix(1.0 + np.arange(1, a + 1), c)
                if tps > best:
                    d, best = cand[:g], tps
        else:
            d = src.plan(n_ctx, room)
        a = accept_greedy(d, target_at)[0]
        if d:
            round_s = c.verify(len(d) + 1)
            seconds += round_s
            src.update(len(d), a, round_s)
        else:
            seconds += c.plain
            src.plain_step(c.plain)   # as generate_spec tells it (the correction fades)
        emitted = output[t:t + a + 1]
        plain += c.plain * len(emitted)
        src.extend(emitted, emitted=True)
        t += len(emitted)
        rounds += 1
        drafted += len(d)
        accepted += a
    return Simulated(len(output) - 1, seconds, plain, rounds, drafted, accepted)


def first_guess(X: np.ndarray) -> np.ndarray:
    """Rows of ``X`` that are the first token of a proposal made before the drafter's first
    guess in this output: the answer's first free draft, in chat mostly a phrase of the
    prompt matched on two tokens."""
    return (X[:, FEATURES.index("log1p_guesses")] == 0) & (X[:, FEATURES.index("position")] == 0)


def first_guess_scale(nets: tuple, parts: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Observed over predicted acceptance of the ``first_guess`` rows of every stream's
    samples (``parts``: ``samples()`` of each) under ``nets`` (1 where there are none). The
    nets, smooth in the guess count and the position, put these at 0.55 on the dev streams
    where 0.35 were accepted (111 rows, about one a stream, which the loss barely weighs:
    keeping all of them in the pool, or adding a first-guess feature, moved it to
    0.51-0.52); scaled, the 5-fold held-out replay gained in 7 of 8 categories
    (docs/draft-length.md)."""
    X = np.concatenate([X[first_guess(X)] for X, _ in parts if len(X)] or
                       [np.zeros((0, len(FEATURES)))])
    y = np.concatenate([y[first_guess(X)] for X, y in parts if len(X)] or [np.zeros(0)])
    if not len(y):
        return 1.0
    predicted = float(CopyModel(nets).predict(X).mean())   # the nets alone, unscaled
    return float(y.mean() / predicted) if predicted > 0 else 1.0


def copy_break_rate(streams: list[dict]) -> float:
    """Of the output tokens met while the long-copy rule holds
    (``ContextSource.in_long_copy``), the share at which the copy broke off; with half a
    break and one token added, so that streams without such copies give a small rate, not
    zero."""
    breaks = seen = 0
    for s in streams:
        src = _start(s["prompt"], s["output"])
        for t in s["output"][1:]:
            nxt = src.copy_continuation(1) if src.in_long_copy() else []
            if nxt:
                seen += 1
                breaks += nxt[0] != t
            src.extend([t], emitted=True)
    return (breaks + 0.5) / (seen + 1.0)


def _pool(parts: list[tuple[np.ndarray, np.ndarray]], per_stream: int, seed: int
          ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    kept = []
    for X, y in parts:
        if 0 < per_stream < len(y):
            keep = np.sort(rng.choice(len(y), per_stream, replace=False))
            X, y = X[keep], y[keep]
        kept.append((X, y))
    if not kept:
        return np.zeros((0, len(FEATURES))), np.zeros(0)
    return np.concatenate([p[0] for p in kept]), np.concatenate([p[1] for p in kept])


def dataset(streams: list[dict], per_stream: int = 0, seed: int = 0
            ) -> tuple[np.ndarray, np.ndarray]:
    """The samples of every stream; ``per_stream`` > 0 keeps at most that many of each (a
    seeded random subset), so that outputs that copy long runs (a code edit gives ~15
    samples a position) do not drown the chat answers that copy little."""
    return _pool([samples(s["prompt"], s["output"]) for s in streams], per_stream, seed)


def fit(streams: list[dict], hidden: int = 16, epochs: int = COPY_EPOCHS, seed: int = 0,
        per_stream: int = COPY_PER_STREAM, members: int = COPY_MEMBERS, meta: dict | None = None
        ) -> CopyModel:
    """Fit on greedy output streams (``{"prompt": [...], "output": [...]}`` each):
    ``members`` nets, seeds ``seed``, ``seed + 1``, ..., each on its own subsample."""
    parts = [samples(s["prompt"], s["output"]) for s in streams]
    nets = []
    for k in range(members):
        X, y = _pool(parts, per_stream, seed + k)
        if len(X) < 200:
            raise SpeceeError(f"too few proposed tokens to fit a copy model ({len(X)}); "
                              f"profile more or longer outputs")
        nets.append(train_mlp(X, y, hidden=hidden, epochs=epochs, seed=seed + k))
    return CopyModel(tuple(nets), dict(meta or {}, n_samples=int(len(X)),
                                       n_streams=len(streams), base_rate=float(y.mean()),
                                       hidden=hidden, copy_break=copy_break_rate(streams),
                                       first_scale=first_guess_scale(tuple(nets), parts)))


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def held_out_report(streams: list[dict], costs, meta: dict | None = None,
                    more_costs: dict | None = None, is_eog=None) -> dict:
    """Fit without every fifth stream (from the second, so that the held-out ones span the
    sources) and score on those: log loss against the built-in guess (share x 2/3, its
    prior) and the base rate, and the simulated speed-up over plain decoding with
    ``costs`` (``simulated``), per category, of the drafter with the fitted model, with its
    guess and with an oracle's knowledge of what will be accepted. ``more_costs`` (name ->
    costs) replays the same fit under other cost tables too (``simulated_more``);
    ``is_eog`` as in ``simulate``."""
    held = set(range(1, len(streams), 5))
    train = [s for i, s in enumerate(streams) if i not in held]
    test = [s for i, s in enumerate(streams) if i in held]
    model = fit(train, meta=meta)
    X, y = dataset(test, COPY_PER_STREAM)   # weighted as in fitting: each stream alike
    rep: dict = {"n_train_streams": len(train), "n_held_out_streams": len(test),
                 "n_train_samples": model.meta["n_samples"], "n_held_out_samples": int(len(y))}
    if len(y):
        rep["log_loss_fitted"] = _log_loss(model.predict(X), y)
        rep["log_loss_guess"] = _log_loss(X[:, 0] * 2 / 3, y)
        rep["log_loss_base_rate"] = _log_loss(np.full(len(y), y.mean()), y)
        rep["held_out_base_rate"] = float(y.mean())
    rep["simulated"] = replay(test, model, costs, is_eog)
    if more_costs:
        rep["simulated_more"] = {name: replay(test, model, c, is_eog)
                                 for name, c in more_costs.items()}
    return rep


def replay(test: list[dict], model: CopyModel, costs, is_eog=None,
           total: str | None = None, timing=None, as_run: bool = False) -> dict:
    """Per category: simulated speed-up over plain of the fitted model, the guess and the
    oracle on the streams ``test``, with drafted/accepted counts; ``total``, if given, names
    one more row over every stream; ``timing`` as in ``simulate``; ``as_run``: the fitted
    model's and the guess's drafters each with a guard per answer and a verification scale
    over the streams in order (``simulate``'s ``as_run``)."""
    scales = {"fitted": VerifyScale(), "guess": VerifyScale()} if as_run else {}
    per: dict[str, dict] = {}
    for s in test:
        rows = [per.setdefault(cat, {"streams": 0, "fitted": [0.0, 0.0], "guess": [0.0, 0.0],
                                     "drafted": [0, 0], "accepted": [0, 0],
                                     "oracle": [0.0, 0.0]})
                for cat in (s.get("category", "?"), total) if cat is not None]
        limit = s.get("max_tokens")
        runs = {"oracle": simulate(s["prompt"], s["output"], costs, oracle=True, limit=limit,
                                   is_eog=is_eog, timing=timing)}
        for m in (model, None):
            name = "fitted" if m is not None else "guess"
            runs[name] = simulate(s["prompt"], s["output"], costs, m, limit=limit,
                                  is_eog=is_eog, timing=timing, as_run=scales.get(name))
        for row in rows:
            row["streams"] += 1
            for name, r in runs.items():
                row[name][0] += r.seconds
                row[name][1] += r.plain_seconds
            for k, name in enumerate(("fitted", "guess")):
                row["drafted"][k] += runs[name].drafted
                row["accepted"][k] += runs[name].accepted
    return {cat: {"streams": r["streams"],
                  "speedup_fitted": r["fitted"][1] / r["fitted"][0],
                  "speedup_guess": r["guess"][1] / r["guess"][0],
                  "speedup_oracle": r["oracle"][1] / r["oracle"][0],
                  "drafted_fitted": r["drafted"][0], "accepted_fitted": r["accepted"][0],
                  "drafted_guess": r["drafted"][1], "accepted_guess": r["accepted"][1]}
            for cat, r in sorted(per.items())}

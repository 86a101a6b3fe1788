"""Free drafts from the context: a depth-limited suffix trie with counts (SuffixDecoding,
arXiv 2411.04975) over the prompt and the output so far.

Every substring of up to ``depth`` tokens that occurred is a path from the root; a node's
count says how often its substring occurred, so a child's share of its parent's count is
how often that token followed. Appending a token extends the ``depth`` paths that end at
the previous position (O(depth) dictionary updates). A draft starts at the longest suffix
of the context that occurred before with something after it, follows the most frequent
child while its share stays high, and re-matches on the extended context when the trie's
depth runs out. Its per-token shares are the drafter's acceptance estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import (BANDS, COPY_GRAM, COPY_PRIOR, FOLLOW_HITS, FOLLOW_MIN, HIT_ALPHA, HIT_PRIOR,
                      MAX_FREE_VERIFY, MAX_VERIFY, TRIE_DEPTH)
from .acceptance import Correction
from .prediction import Prediction, assumed_costs


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: list[float]      # per token: how often it followed (share of its parent's count)
    match: int              # length of the matched context suffix
    # per token: the length of the suffix it was matched on, and how often that suffix
    # occurred with a successor (the support of its share)
    matches: list[int] = field(default_factory=list)
    supports: list[int] = field(default_factory=list)


class SuffixTrie:
    def __init__(self, depth: int = TRIE_DEPTH):
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.child: dict[tuple[int, int], int] = {}    # (node, token) -> node
        self.kids: list[list[int]] = [[]]               # node -> its children's tokens
        self.count: list[int] = [0]
        self.tokens: list[int] = []
        self._open: list[int] = []   # nodes of the substrings ending at the last position

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            nxt = []
            for node in [0] + self._open[: self.depth - 1]:
                key = (node, t)
                c = self.child.get(key)
                if c is None:
                    c = len(self.count)
                    self.child[key] = c
                    self.count.append(0)
                    self.kids.append([])
                    self.kids[node].append(t)
                self.count[c] += 1
                nxt.append(c)
            self._open = nxt   # shortest first: the substring of length 1, 2, ...
            self.tokens.append(t)

    def cut(self) -> None:
        """End a run of tokens: no substring will span this point (between two stored
        outputs of the history, say)."""
        self._open = []

    def _node(self, path) -> int | None:
        node = 0
        for t in path:
            node = self.child.get((node, t))
            if node is None:
                return None
        return node

    def _match(self, ctx: list[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of ``ctx`` (at most depth - 1 tokens, so
        that a child can follow) whose node has children, i.e. occurred with a successor."""
        for n in range(min(self.depth - 1, len(ctx)), 0, -1):
            node = self._node(ctx[-n:])
            if node is not None and self.kids[node]:
                return node, n
        return 0, 0

    def propose(self, n_max: int, min_match: int = 2, min_prob: float = 0.3,
                ctx: list[int] | None = None) -> Proposal:
        """Up to ``n_max`` tokens likely to follow the context (``ctx``, default this trie's
        own tokens: another trie's context looks up this one); empty when no suffix of
        ``min_match`` tokens occurred before."""
        ctx = (self.tokens if ctx is None else ctx)[-(self.depth - 1):]
        out: list[int] = []
        probs: list[float] = []
        matches: list[int] = []
        supports: list[int] = []
        first_match = 0
        while len(out) < n_max:
            node, n = self._match(ctx)
            if n < min_match:
                break
            first_match = first_match or n
            total = sum(self.count[self.child[(node, t)]] for t in self.kids[node])
            tok = max(self.kids[node], key=lambda t: self.count[self.child[(node, t)]])
            p = self.count[self.child[(node, tok)]] / total
            if p < min_prob:
                break
            out.append(tok)
            probs.append(p)
            matches.append(n)
            supports.append(total)
            ctx = (ctx + [tok])[-(self.depth - 1):]
        return Proposal(out, probs, first_match, matches, supports)


def copy_features(prop: Proposal, recent: float, overall: float, run: int, guesses: int,
                  source: float = 0.0, back: int = 0) -> np.ndarray:
    """The copy model's inputs, one row per proposed token (context_acceptance.py): its share,
    log(1 + support), the length of the suffix it was matched on and its position in the
    draft; and, the same for every row, how often the trie's first guess was right over the
    recent output and over all of it, log(1 + its current run of right guesses) and
    log(1 + the guesses it made so far) (how much the overall rate has seen); where the copy
    being followed comes from (``source``: -1 the prompt, 1 this output, 0 none) and, for a
    copy of this output, log(1 + how many tokens back it is) (0 otherwise)."""
    n = len(prop.tokens)
    per_draft = [recent, overall, np.log1p(run), np.log1p(guesses), source, np.log1p(back)]
    return np.column_stack([prop.probs, np.log1p(prop.supports), prop.matches, np.arange(n),
                            np.tile(per_draft, (n, 1))]).astype(np.float64)


def best_prefix(expect, costs) -> tuple[int, float]:
    """(g, tokens per second) of the free draft length g that maximises ``expect[g - 1]``
    tokens (expected from drafting g) per verification of g + 1; (0, plain's) where none
    beats plain decoding (a free draft costs only its verification)."""
    plain = 1.0 / costs.plain
    expect = np.asarray(expect, dtype=np.float64)
    if not len(expect):
        return 0, plain
    tps = expect / costs.verify_curve(len(expect) + 1)[1:]
    g = int(np.argmax(tps))   # the shortest of equally good lengths
    return (g + 1, float(tps[g])) if tps[g] > plain else (0, plain)


def free_draft_max(sampling) -> int:
    """The longest free draft for this sampling: sampled verification reads a one-hot
    n_vocab row per drafted token, so there no longer than the draft model's longest."""
    return MAX_FREE_VERIFY - 1 if sampling.greedy else MAX_VERIFY - 1


class ContextSource:
    """The free drafter as a speculative source: each round it proposes a continuation from
    the context and keeps the prefix that maximises expected tokens per second under this
    machine's costs (a free draft costs only its verification), or nothing when plain
    decoding is faster.

    A drafted token's acceptance (given the tokens before it were accepted) is predicted by
    the copy model fitted for the target (``model``, context_acceptance.py) from the trie's share
    and support, the match length, the position, and how the trie's first guess has fared on
    this output (``features``). Without one it is estimated as the trie's share times the
    acceptance rate of context drafts with a match of that length so far in this run (a Beta
    posterior per match-length band, prior mean 2/3: a first guess that is worth one short
    draft where verification is dear, and learns within a few rounds whether copying works
    here).

    ``history``, if given, is a trie over the user's earlier outputs (speculative/history.py): where
    its match with the current context is longer than the context's own, it proposes
    instead, with Beta posteriors of its own (the copy model is fitted on the context's
    drafts only).

    ``prediction``, if given, is the caller's predicted output (speculative/prediction.py):
    while the output follows it, its continuation is a third candidate, taken where it is
    expected to beat the others. Without a cost table (``costs`` None: plain mode) the
    prediction is the only source, priced at the dearest verification rows measured
    anywhere."""

    BANDS, COPY_PRIOR, HIT_ALPHA, HIT_PRIOR = BANDS, COPY_PRIOR, HIT_ALPHA, HIT_PRIOR   # config

    def __init__(self, costs, depth: int = TRIE_DEPTH, n_max: int = MAX_VERIFY - 1,
                 history: SuffixTrie | None = None, model=None,
                 follow_max: int = MAX_FREE_VERIFY - 1,
                 is_eog: Callable[[int], bool] | None = None, guard=None,
                 verify_scale=None, prediction: Prediction | None = None):
        from .cost import as_table

        self.table = as_table(costs) if costs is not None else None
        self.prediction = prediction
        # no table, a prediction: it drafts alone (plain mode), the trie is not kept
        self.prediction_only = costs is None and prediction is not None
        self.trie = SuffixTrie(depth)
        self.history = history
        self.model = model
        self.n_max = n_max
        n = len(self.BANDS) + 1
        # per source (0: this context, 1: the history) and match band: accepted, rejected
        self.beta = [[[2.0, 1.0] for _ in range(n)] for _ in range(2)]
        self.hits = self.HIT_PRIOR
        self.run = 0                  # output tokens in a row the first guess got right
        self.guessed = [0, 0]         # over the whole output: first guesses right, made
        self.expected_tps = 0.0       # of the last plan (tokens per second, this machine)
        # the copy being followed: the position after the latest earlier occurrence of the
        # context's last COPY_GRAM tokens, advanced while the context keeps copying it
        self._last_at: dict[tuple, int] = {}
        self._ptr: int | None = None
        self.copy_len = 0
        self.n_given = 0              # tokens given, not emitted (the prompt): copies from
        # there and from the output so far fare differently (copy_features' source)
        # the longest follow draft: MAX_VERIFY - 1 where verification is sampled (each
        # drafted token costs a one-hot n_vocab row there)
        self.follow_max = follow_max
        # end-of-generation tokens (the chat template's end of turn, copied from the prompt):
        # a draft ends with one, as the answer would; rows after it would be verified for
        # nothing (5% of the replayed time of dev code edits)
        self.is_eog = is_eog
        self._band = 0
        self._src = 0
        # what short drafts (not a followed copy) really reach against plain steps
        # (policies.Guard, one per generation): where the copy model promises more than this
        # work gives (code written from a docstring: 11% of HumanEval's context drafts
        # accepted on the AMX Xeon), it holds them back and probes again later; None: never
        self.guard = guard
        self._short = False
        # what its verification batches really cost against the table (cost.VerifyScale,
        # kept with the pair; None: the table as measured), taught by its own rounds and the
        # plain steps between them
        self.verify_scale = verify_scale
        self._at = None               # the table's costs at the last plan's context
        self._priced = None           # the costs the last plan priced its drafts with
        # the copy model's short drafts checked against this answer's rounds: accepted over
        # predicted tokens, shrunk towards 1 by COPY_PRIOR rounds as predicted, scales the
        # first token's acceptance (``accept_probs``). The nets are fitted on chat answers
        # and code edits; on code written from a docstring (HumanEval) they put a
        # two-token draft's first token at 0.55-0.69 where 0.28 of its tokens were accepted,
        # even as the trie's first guesses fell to 12% right (its replay with the 2-core
        # EPYC's costs: 0.969x plain; 0.988x with the correction, every other category
        # within 0.01x of before: docs/draft-length.md). Per answer, like the
        # guard: what copying reaches depends on what this prompt holds.
        self.correction = Correction(prior=self.COPY_PRIOR, lo=0.0) if model is not None \
            else None
        self._raw: np.ndarray | None = None   # the copy model's last uncorrected probs
        self._predicted = 0.0         # the last short draft's accepted tokens, predicted

    def _rate(self, src: int, band: int) -> float:
        a, b = self.beta[src][band]
        return a / (a + b)

    def extend(self, tokens, emitted: bool = False) -> None:
        """Add ``tokens`` to the context. ``emitted`` tokens (decoded, not the prompt) are
        first checked one by one against the trie's first guess at their position, which
        keeps the recent hit rate and the current run of hits (a few dictionary lookups a
        token), and advance the prediction."""
        if emitted and self.prediction is not None:
            self.prediction.observe(tokens)
        if self.prediction_only:
            return
        if not emitted:
            self.n_given += len(tokens)
            for t in tokens:
                self._follow(t)
                self.trie.extend([t])
            return
        for t in tokens:
            guess = self.trie.propose(1).tokens
            hit = bool(guess) and guess[0] == t
            if guess:
                self.hits += self.HIT_ALPHA * (float(hit) - self.hits)
                self.guessed[0] += hit
                self.guessed[1] += 1
            self.run = self.run + 1 if hit else 0
            self._follow(t)
            self.trie.extend([t])

    def output_began(self, token: int) -> None:
        """The output's first token (added to the context with the prompt, whose logits gave
        it): the prediction is followed from there."""
        if self.prediction is not None:
            self.prediction.observe([token])

    # A long copy in progress (its last FOLLOW_MIN tokens repeat an earlier stretch
    # token for token, and the trie's first guesses have been right >= FOLLOW_HITS of the
    # recent time) is drafted from that stretch, as far as it goes, up to a batch of
    # MAX_FREE_VERIFY and the caller's limit: where a row of a long batch costs less than
    # one of a short batch (config.LONG_BATCHES), copying long pays, and such a copy breaks
    # off rarely (0.6% of the followed tokens of dev code edits). Chosen on dev streams
    # (5-fold replay on a 2-core EPYC's cost table, no draft past max_tokens): code edits
    # 1.575x of plain without the rule, 1.681x drafting 15 tokens first and doubling while
    # kept whole, 1.743x drafting the whole stretch (docs/draft-length.md, "Long copies").
    # llama.cpp's ngram-map-k drafts up to 48 tokens after a 12-token match.
    COPY_GRAM, FOLLOW_MIN, FOLLOW_HITS = COPY_GRAM, FOLLOW_MIN, FOLLOW_HITS   # config

    def _follow(self, t: int) -> None:
        """Before ``t`` joins the context: advance the followed copy if ``t`` continues it,
        else drop it; then find the latest earlier occurrence of the last COPY_GRAM tokens
        (with ``t``) to follow next. O(1) a token."""
        toks = self.trie.tokens
        if self._ptr is not None and self._ptr < len(toks) and toks[self._ptr] == t:
            self._ptr += 1
            self.copy_len += 1
        else:
            self._ptr, self.copy_len = None, 0
        k = self.COPY_GRAM
        if len(toks) + 1 >= k:
            gram = tuple(toks[len(toks) - k + 1:]) + (t,)
            at = self._last_at.get(gram)
            if self._ptr is None and at is not None:
                self._ptr, self.copy_len = at, k
            self._last_at[gram] = len(toks) + 1

    def propose(self) -> Proposal:
        """What the context (or the history, where its match is longer) says comes next."""
        prop, self._src = self.trie.propose(self.n_max), 0
        if self.history is not None:
            other = self.history.propose(self.n_max, ctx=self.trie.tokens)
            if other.tokens and other.match > prop.match:
                prop, self._src = other, 1
        self._band = sum(prop.match >= b for b in self.BANDS)
        return prop

    @property
    def source(self) -> str:
        """Where the last plan's draft came from: this context, the history store or the
        prediction."""
        return ("context", "history", "prediction")[self._src]

    def features(self, prop: Proposal) -> np.ndarray:
        """The copy model's inputs for ``prop`` in this state (``copy_features``); the overall
        hit rate starts from one hit and one miss."""
        right, made = self.guessed
        source, back = 0.0, 0
        if self._ptr is not None and self._ptr < self.n_given:
            source = -1.0
        elif self._ptr is not None:
            # how far back only for a copy of this output's own text: with the distance of
            # copies from the prompt too, the 5-fold dev replay gained on code edits (1.876x
            # against 1.850x) but lost on RAG answers (0.959x against 1.004x), whose copies
            # from a document far back break off within a few tokens
            source, back = 1.0, len(self.trie.tokens) - self._ptr
        return copy_features(prop, self.hits, (right + 1) / (made + 2), self.run, made,
                             source, back)

    def accept_probs(self, prop: Proposal) -> np.ndarray:
        """Per proposed token: the probability that it is accepted if the ones before were
        (the copy model's, its first token's scaled by this answer's ``correction``)."""
        if self.model is not None and self._src == 0:
            p = self.model.predict(self.features(prop))
            self._raw = p
            if self.correction is not None and len(p):
                # the first token alone: it decides whether a short draft is made at all;
                # scaling every token compounded down the draft and cut the longer drafts
                # of RAG answers and summaries, which the nets rate well (replay: RAG
                # 1.194x -> 1.164x, summaries 1.297x -> 1.257x)
                p = p.copy()
                p[0] = min(p[0] * self.correction.factor, 0.99)
            return p
        self._raw = None
        return np.asarray(prop.probs) * self._rate(self._src, self._band)

    def to_end(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to and with the first end-of-generation token."""
        if self.is_eog is not None:
            for i, t in enumerate(tokens):
                if self.is_eog(t):
                    return tokens[:i + 1]
        return tokens

    def copy_continuation(self, n: int) -> list[int]:
        """Up to ``n`` tokens that follow the copied stretch in the context, to the first
        end of generation (empty: the context's last COPY_GRAM tokens occurred nowhere
        before)."""
        if self._ptr is None:
            return []
        return self.to_end(self.trie.tokens[self._ptr:self._ptr + n])

    def in_long_copy(self) -> bool:
        """Whether the long-copy rule holds: a copy of FOLLOW_MIN+ tokens in progress and the
        trie's first guesses right >= FOLLOW_HITS of the recent time."""
        return self.copy_len >= self.FOLLOW_MIN and self.hits >= self.FOLLOW_HITS

    def _long_copy(self, costs, room: int) -> list[int]:
        """The followed copy's continuation (at most ``room`` tokens), as long as the costs
        make it pay with each token kept with probability 1 - the copy model's break rate
        (every token without a model); empty unless a long copy is in progress
        (``in_long_copy``)."""
        if not self.in_long_copy():
            return []
        own = self.copy_continuation(min(self.follow_max, room))
        # A copy breaks off at 0.7% of its tokens (dev streams, copy_model.copy_break_rate):
        # counting that, a 63-token draft expects 50.6 tokens, a 47-token one 39.9, and
        # where verify(64) is dear the shorter one wins (held-out replay, version-8 table:
        # code edits 1.761x -> 1.800x; version-7 table: no change; docs/draft-length.md)
        q = 1.0 - (self.model.copy_break if self.model is not None else 0.0)
        best_g, best = best_prefix(1.0 + np.cumsum(q ** np.arange(1, len(own) + 1)), costs)
        if best_g:
            self.expected_tps, self._src, self._band = best, 0, len(self.BANDS)
        return own[:best_g]

    def _from_prediction(self, costs, room: int) -> tuple[list[int], float]:
        """The prediction's continuation as far as it pays, with its expected tokens per
        second (empty: the output is not in the prediction, or drafting it cannot pay)."""
        if self.prediction is None:
            return [], 0.0
        return self._paying(*self.prediction.continuation(room), costs)

    def _paying(self, tokens: list[int], p: np.ndarray, costs) -> tuple[list[int], float]:
        """The prefix of the prediction's ``tokens`` (each right with probability ``p`` if
        the ones before were) that maximises expected tokens per second under ``costs``,
        to the first end of generation, with that rate (empty: none pays)."""
        tokens = self.to_end(tokens)   # a prediction given as token ids may hold the end
        if not tokens:
            return [], 0.0
        g, tps = best_prefix(1.0 + np.cumsum(np.cumprod(p[:len(tokens)])), costs)
        return tokens[:g], tps

    def rejoin(self, drafted: list[int], room: int | None = None) -> list[int]:
        """Tokens to verify after ``drafted`` (this round's draft model tokens) where they
        would bring the output back to the prediction it left: its continuation from there,
        as far as the prediction would draft it had the output rejoined it (empty: they
        would not rejoin it, or drafting it cannot pay). One verification then covers an
        edit's new text and the unchanged text after it, which otherwise take a round each.
        Not the whole continuation: on dev code edits that lost, the draft model's new
        text being rejected often enough that so many rows are mostly wasted."""
        if self.prediction is None or self._priced is None:
            return []
        room = self.follow_max if room is None else min(room, self.follow_max)
        tail, p = self.prediction.rejoin_tail(drafted, room - len(drafted))
        return self._paying(tail, p, self._priced)[0]   # priced as this round's plan

    def plan(self, n_context: int, room: int | None = None) -> list[int]:
        """This round's free draft for a cache of ``n_context`` tokens, at most ``room``
        tokens (the caller's limit); empty: plain decoding pays more."""
        # never past follow_max, whatever the caller's limit: a verification of more rows
        # than MAX_FREE_VERIFY is not computed as one-token decodes are (docs/kernels.md)
        room = self.follow_max if room is None else min(room, self.follow_max)
        if self.table is None:   # the prediction alone, at prices safe on any machine
            costs = self._priced = assumed_costs()
            pred, tps = self._from_prediction(costs, room)
            self.expected_tps, self._src = (tps, 2) if pred else (1.0 / costs.plain, 0)
            return pred
        costs = self._at = self.table.at(n_context)
        if self.verify_scale is not None:
            costs = self.verify_scale.apply(costs)
        self._priced = costs
        self.expected_tps = 1.0 / costs.plain
        if self.guard is not None:
            # plain steps slow down as the cache grows; until one is seen at this length the
            # guard compares short drafts with the table's plain token here, not at 128
            self.guard.plain_prior = self.expected_tps
        if room < 1:
            return []
        self._short = False
        pred, pred_tps = self._from_prediction(costs, room)
        long = self._long_copy(costs, room)
        if long and (not pred or self.expected_tps >= pred_tps):
            return long
        if pred:   # the trie's short drafts are no rival for a prediction that pays
            self.expected_tps, self._src = pred_tps, 2
            return pred
        prop = self.propose()
        tokens = self.to_end(prop.tokens[:room])
        if not tokens:
            return []
        # expected tokens of a round drafting g: 1 + P(first accepted) + P(first two) + ...
        expect = 1.0 + np.cumsum(np.cumprod(self.accept_probs(prop)[:len(tokens)]))
        best_g, tps = best_prefix(expect, costs)
        if best_g and self.guard is not None and not self.guard.gate(best_g):
            return []   # held back: short drafts lost here lately
        self.expected_tps, self._short = tps, best_g > 0
        if best_g and self._raw is not None:
            self._predicted = float(np.cumprod(self._raw[:best_g]).sum())
        return tokens[:best_g]

    def update(self, n_drafted: int, n_accept: int, seconds: float = 0.0) -> None:
        """After a context round that took ``seconds``: tokens before the first rejection
        were accepted (each a success), the first rejected one a failure, the rest
        unobserved."""
        if n_drafted:
            if self.verify_scale is not None and self._at is not None:
                self.verify_scale.observe(self._at, n_drafted + 1, seconds)
            if self._src == 2:
                self.prediction.learn(n_drafted, n_accept)
                return
            self.beta[self._src][self._band][0] += n_accept
            self.beta[self._src][self._band][1] += n_accept < n_drafted
            if self._short and self.correction is not None and self._raw is not None:
                self.correction.observe(self._predicted, n_accept)
            if self.guard is not None and self._short and seconds > 0:
                self.guard.observe(n_drafted, n_accept + 1, seconds)

    def rejoined(self, n_drafted: int, n_accept: int) -> None:
        """A round verified ``n_drafted`` tokens of the prediction after the draft model's
        tokens (``rejoin``), all of which were accepted, and ``n_accept`` of these."""
        self.prediction.learn(n_drafted, n_accept)

    def plain_step(self, seconds: float) -> None:
        """A plain decoding step took ``seconds`` (what short drafts must beat)."""
        if self.correction is not None:
            self.correction.plain_step()
        if self.verify_scale is not None and self._at is not None:
            self.verify_scale.observe(self._at, 1, seconds)
        if self.guard is not None and seconds > 0:
            self.guard.observe(0, 1, seconds)

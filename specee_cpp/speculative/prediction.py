"""The caller's predicted output (OpenAI's ``prediction``) as a draft source.

An edit repeats most of the text the caller already holds. The prediction's tokens are
followed from where the output stands in them: while the output keeps to the prediction its
continuation is drafted, as long as this machine's costs make the expected run pay; after a
divergence (an edit inserts, deletes or changes tokens) nothing is drafted from it until the
output rejoins it: its last PREDICTION_GRAM tokens found in the prediction near the point
it left (the first such place, since an edit moves forward through the text), or its last
PREDICTION_FAR_GRAM tokens anywhere (a moved block). How often a drafted token is right is
learned per answer, apart by how far into a run of the prediction the output will be when it
comes (PREDICTION_BANDS): a token just after a (re)join breaks often, one deep in an edit's
unchanged stretch hardly ever, so a long run is drafted long, and an unrelated prediction,
whose chance rejoins break at once, soon stops drafting.

An edit repeats itself: a renamed variable is renamed wherever it occurs. Where the output
left the prediction and rejoined it, having put a few tokens in place of a short span of it
(PREDICTION_SPAN), that substitution is learned, and later occurrences of the span are
drafted (and followed) as their replacement, until the output keeps the original where the
substitution was expected more often than it made it.

Verification keeps the output the target's: greedy output equals plain decoding's.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..config import (PREDICTION_BANDS, PREDICTION_FAR_GRAM, PREDICTION_GRAM,
                      PREDICTION_NEAR, PREDICTION_PRIORS, PREDICTION_REPLACEMENT,
                      PREDICTION_ROW_COST, PREDICTION_SPAN, PREDICTION_TAIL_RUN)


class Prediction:
    """Where the output stands in the predicted tokens, and how far to draft from there."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.at: int | None = 0 if self.tokens else None   # next expected token's index
        self.left = 0              # where the output last left the prediction (or started)
        self.run = 0               # output tokens in a row that followed it
        self.longest = 0           # the longest such run so far
        self._near = self._index(PREDICTION_GRAM)
        self._far = self._index(PREDICTION_FAR_GRAM)
        self._last: list[int] = []
        # per band of run length (PREDICTION_BANDS): [kept, broken] drafted tokens
        self.beta = [list(prior) for prior in PREDICTION_PRIORS]
        self._run0 = 0   # the run length where the last continuation began
        # the edit's substitutions: a span of the prediction -> [its replacement, times the
        # output made it, times it kept the original instead]; by the span's first token
        self.subs: dict[tuple, list] = {}
        self._spans: dict[int, list[tuple]] = defaultdict(list)
        self._detour: list[int] | None = None   # output since it left a followed stretch
        self._in: tuple[tuple, int] | None = None   # (span, replacement tokens out so far)
        self._pending: tuple[tuple, list[int]] | None = None   # learned once its rejoin holds

    def _index(self, n: int) -> dict[tuple, list[int]]:
        """n-gram -> the positions after each of its occurrences, in order."""
        at: dict[tuple, list[int]] = defaultdict(list)
        t = self.tokens
        for i in range(len(t) - n + 1):
            at[tuple(t[i:i + n])].append(i + n)
        return dict(at)

    def _span_at(self, i: int) -> tuple | None:
        """A learned substitution whose span starts at prediction index ``i``, while the
        output has made it at least as often as it kept the original there."""
        for span in self._spans.get(self.tokens[i], ()) if i < len(self.tokens) else ():
            made, kept = self.subs[span][1:]
            if kept <= made and tuple(self.tokens[i:i + len(span)]) == span:
                return span
        return None

    def _expected(self) -> tuple[int | None, tuple | None]:
        """The token the prediction says comes next (None: the output is not in it) and the
        learned substitution whose span starts there (None: none, or one already begun)."""
        if self.at is None:
            return None, None
        if self._in is not None:
            span, k = self._in
            return self.subs[span][0][k], None
        if self.at >= len(self.tokens):
            return None, None
        span = self._span_at(self.at)
        return (self.subs[span][0][0] if span is not None else self.tokens[self.at]), span

    def _advance(self, span: tuple | None) -> None:
        """The output emitted the expected token, the first of substitution ``span``'s
        replacement where given."""
        if span is not None:
            self._in = (span, 0)
        if self._in is None:
            self.at += 1
        else:
            span, k = self._in
            self._in = (span, k + 1)
            if k + 1 == len(self.subs[span][0]):   # the whole replacement: past the span
                self.subs[span][1] += 1
                self.at += len(span)
                self._in = None
        self.run += 1
        if self._pending is not None:   # the rejoin held a token past its gram
            span, replacement = self._pending
            self.subs[span] = [replacement, 0, 0]
            self._spans[span[0]].append(span)
            self._pending = None

    def observe(self, tokens) -> None:
        """Emitted output tokens, in order."""
        for t in tokens:
            expected, span = self._expected()
            if expected is not None and t == expected:
                self._advance(span)
            elif span is not None and self.tokens[self.at] == t:
                # the original where a substitution was expected: it goes on from there
                self.subs[span][2] += 1
                self.at += 1
                self.run += 1
            else:
                if self._in is not None:
                    self.subs[self._in[0]][2] += 1
                    self._in = None
                self._pending = None   # its rejoin did not hold
                if self.at is not None and self.run:
                    # where a followed stretch ends; a rejoin that broke at once was chance
                    # and moves nothing
                    self.left = self.at
                    self._detour = []
                self.at, self.run = None, 0
            self.longest = max(self.longest, self.run)
            self._last = (self._last + [t])[-PREDICTION_FAR_GRAM:]
            if self.at is None:
                if self._detour is not None:
                    self._detour.append(t)
                self.at, gram = self._rejoin()
                if self.at is not None:
                    self._pending = self._substitution(gram)
                    self._detour = None

    def _substitution(self, gram: int) -> tuple[tuple, list[int]] | None:
        """Having rejoined the prediction on ``gram`` tokens after a detour from a followed
        stretch: (the span it left out, the tokens it put there) where both are short and
        the span is not yet known, a substitution the edit may repeat; None otherwise."""
        if self._detour is None:
            return None
        span = tuple(self.tokens[self.left:self.at - gram])
        replacement = self._detour[:len(self._detour) - gram]
        if 1 <= len(span) <= PREDICTION_SPAN and 1 <= len(replacement) <= \
                PREDICTION_REPLACEMENT and list(span) != replacement and span not in self.subs:
            return span, replacement
        return None

    def _rejoin(self, last: list[int] | None = None) -> tuple[int | None, int]:
        """(where an output ending in ``last``, default its last tokens, rejoins the
        prediction, the length of the gram it rejoined on); (None, 0): not yet."""
        last = self._last if last is None else last[-PREDICTION_FAR_GRAM:]
        near = self._near.get(tuple(last[-PREDICTION_GRAM:]), ())
        for p in near:
            if self.left <= p <= self.left + PREDICTION_NEAR:
                return p, PREDICTION_GRAM
        if len(last) == PREDICTION_FAR_GRAM:
            far = self._far.get(tuple(last), ())
            if far:
                return next((p for p in far if p >= self.left), far[0]), PREDICTION_FAR_GRAM
        return None, 0

    @staticmethod
    def band(run: int) -> int:
        """The band of a token that comes ``run`` tokens into a run of the prediction."""
        return sum(run >= start for start in PREDICTION_BANDS[1:])

    def rate(self, band: int) -> float:
        kept, broken = self.beta[band]
        return kept / (kept + broken)

    def continuation(self, n: int) -> tuple[list[int], np.ndarray]:
        """Up to ``n`` tokens the prediction says come next (empty: the output is not in
        it) and, per token, the probability that it is right if the ones before were."""
        if self.at is None or n < 1:
            return [], np.zeros(0)
        toks = self._ahead(self.at, self._in, n)
        self._run0 = self.run
        return toks, np.array([self.rate(self.band(self.run + i)) for i in range(len(toks))])

    def rejoin_tail(self, drafted: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """Where the output has left the prediction and ``drafted`` tokens (the draft model's,
        not emitted yet) would bring it back: up to ``n`` tokens the prediction says follow
        them, and per token the probability that it is right if the ones before were, as
        for a rejoin of the output itself (empty: the output follows the prediction, or
        ``drafted`` would not rejoin it on its last token). Until the output has followed the
        prediction PREDICTION_TAIL_RUN tokens in a row, a rejoin other than where it left
        (the prediction's start, after a preamble such as a code fence) is priced as a
        rejoin's first token throughout, so its tail is short: code shares short grams, and
        an unrelated prediction's chance rejoins would add rows that break."""
        if self.at is not None or not drafted or n < 1:
            return [], np.zeros(0)
        at, gram = self._rejoin(self._last + list(drafted))
        if at is None:
            return [], np.zeros(0)
        toks = self._ahead(at, None, n)
        self._run0 = 0
        if self.longest < PREDICTION_TAIL_RUN and at - gram != self.left:
            return toks, np.full(len(toks), self.rate(0))
        return toks, np.array([self.rate(self.band(i)) for i in range(len(toks))])

    def _ahead(self, i: int, inside: tuple[tuple, int] | None, n: int) -> list[int]:
        """Up to ``n`` tokens of the prediction from index ``i`` (inside substitution
        ``inside`` where given), learned substitutions made."""
        toks: list[int] = []
        while len(toks) < n:
            if inside is None and i < len(self.tokens):
                span = self._span_at(i)
                inside = (span, 0) if span is not None else None
            if inside is not None:
                span, k = inside
                toks += self.subs[span][0][k:]
                i, inside = i + len(span), None
            elif i < len(self.tokens):
                toks.append(self.tokens[i])
                i += 1
            else:
                break
        return toks[:n]

    def learn(self, n_drafted: int, n_accept: int) -> None:
        """A round drafted ``n_drafted`` tokens of the last continuation, ``n_accept`` of
        them accepted: each accepted token a success in its band, the first rejected one a
        failure in its, the rest unobserved."""
        for i in range(min(n_accept + 1, n_drafted)):
            self.beta[self.band(self._run0 + i)][0 if i < n_accept else 1] += 1


def assumed_costs():
    """A verification's price where no table of this machine's is at hand: the dearest rows
    measured on any machine (config.PREDICTION_ROW_COST), in plain tokens."""
    from ..config import MAX_FREE_VERIFY, MAX_VERIFY
    from .cost import CostModel

    short = [1.0 + PREDICTION_ROW_COST * n for n in range(MAX_VERIFY)]
    return CostModel(target_batch_s=short, draft_token_s=1.0, plain_token_s=1.0,
                     long_sizes=[MAX_FREE_VERIFY],
                     long_batch_s=[1.0 + PREDICTION_ROW_COST * (MAX_FREE_VERIFY - 1)])


def prediction_drafter(llm, prediction: list[int] | Prediction, sampling):
    """The free drafter over the caller's predicted output alone (no context, no draft
    model), priced without this machine's table at the dearest verification measured
    anywhere: what plain decoding, early exit and a run without context drafts draw from
    when given a prediction."""
    from .context_drafter import ContextSource, free_draft_max

    if not isinstance(prediction, Prediction):
        prediction = Prediction(prediction)
    return ContextSource(None, prediction=prediction, follow_max=free_draft_max(sampling),
                         is_eog=llm.model.is_eog)


def generate_predicted(llm, prompt: list[int], prediction: list[int], sampling, max_new: int):
    """Plain decoding that drafts from the caller's predicted output where the output follows
    it, each draft verified by the target in one batch (the speculative loop without a draft
    model): what mode plain runs when given a prediction (engine/plain.py)."""
    from .decode import generate_spec

    return generate_spec(llm.tgt.seq, None, prompt, 0, sampling,
                         context=prediction_drafter(llm, prediction, sampling),
                         max_new=max_new, is_eog=llm.model.is_eog)

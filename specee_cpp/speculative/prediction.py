"""The caller's predicted output (OpenAI's ``prediction``) as a draft source.

An edit repeats most of the text the caller already holds. The prediction's tokens are
followed from where the output stands in them: while the output keeps to the prediction its
continuation is drafted, as long as this machine's costs make the expected run pay; after a
divergence (an edit inserts, deletes or changes tokens) nothing is drafted from it until the
output rejoins it: its last PREDICTION_GRAM tokens found in the prediction near the point
it left (the first such place, since an edit moves forward through the text), or its last
PREDICTION_FAR_GRAM tokens anywhere (a moved block). How often a drafted token is right is
learned per answer, apart for a token just after a (re)join and one inside a run the output
has followed, so an unrelated prediction, whose chance rejoins break at once, soon stops
drafting.

Verification keeps the output the target's: greedy output equals plain decoding's.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..config import (PREDICTION_FAR_GRAM, PREDICTION_GRAM, PREDICTION_NEAR,
                      PREDICTION_PRIOR_JOIN, PREDICTION_PRIOR_RUN, PREDICTION_ROW_COST,
                      PREDICTION_RUN)


class Prediction:
    """Where the output stands in the predicted tokens, and how far to draft from there."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.at: int | None = 0 if self.tokens else None   # next expected token's index
        self.left = 0              # where the output last left the prediction (or started)
        self.run = 0               # output tokens in a row that followed it
        self._near = self._index(PREDICTION_GRAM)
        self._far = self._index(PREDICTION_FAR_GRAM)
        self._last: list[int] = []
        # per band (0: just joined, 1: inside a run): [kept, broken] drafted tokens
        self.beta = [list(PREDICTION_PRIOR_JOIN), list(PREDICTION_PRIOR_RUN)]
        self._band = 0

    def _index(self, n: int) -> dict[tuple, list[int]]:
        """n-gram -> the positions after each of its occurrences, in order."""
        at: dict[tuple, list[int]] = defaultdict(list)
        t = self.tokens
        for i in range(len(t) - n + 1):
            at[tuple(t[i:i + n])].append(i + n)
        return dict(at)

    def observe(self, tokens) -> None:
        """Emitted output tokens, in order."""
        for t in tokens:
            if self.at is not None and self.at < len(self.tokens) and self.tokens[self.at] == t:
                self.at += 1
                self.run += 1
            else:
                if self.at is not None and self.run:
                    # where a followed stretch ends; a rejoin that broke at once was chance
                    # and moves nothing
                    self.left = self.at
                self.at, self.run = None, 0
            self._last = (self._last + [t])[-PREDICTION_FAR_GRAM:]
            if self.at is None:
                self.at = self._rejoin()

    def _rejoin(self) -> int | None:
        near = self._near.get(tuple(self._last[-PREDICTION_GRAM:]), ())
        for p in near:
            if self.left <= p <= self.left + PREDICTION_NEAR:
                return p
        if len(self._last) == PREDICTION_FAR_GRAM:
            far = self._far.get(tuple(self._last), ())
            if far:
                return next((p for p in far if p >= self.left), far[0])
        return None

    def rate(self, band: int) -> float:
        kept, broken = self.beta[band]
        return kept / (kept + broken)

    def continuation(self, n: int) -> tuple[list[int], np.ndarray]:
        """Up to ``n`` tokens the prediction says come next (empty: the output is not in
        it) and, per token, the probability that it is right if the ones before were."""
        if self.at is None or n < 1:
            return [], np.zeros(0)
        toks = self.tokens[self.at:self.at + n]
        self._band = int(self.run >= PREDICTION_RUN)
        p = np.full(len(toks), self.rate(1))
        if len(p):
            p[0] = self.rate(self._band)
        return toks, p

    def learn(self, n_drafted: int, n_accept: int) -> None:
        """A round drafted ``n_drafted`` of its tokens, ``n_accept`` of them accepted."""
        if not n_drafted:
            return
        first = self.beta[self._band]
        first[0 if n_accept else 1] += 1
        if n_drafted > 1 and n_accept:
            rest = self.beta[1]
            rest[0] += n_accept - 1
            rest[1] += n_accept < n_drafted


def assumed_costs():
    """A verification's price where no table of this machine's is at hand: the dearest rows
    measured on any machine (config.PREDICTION_ROW_COST), in plain tokens."""
    from ..config import MAX_FREE_VERIFY, MAX_VERIFY
    from .cost import CostModel

    short = [1.0 + PREDICTION_ROW_COST * n for n in range(MAX_VERIFY)]
    return CostModel(target_batch_s=short, draft_token_s=1.0, plain_token_s=1.0,
                     long_sizes=[MAX_FREE_VERIFY],
                     long_batch_s=[1.0 + PREDICTION_ROW_COST * (MAX_FREE_VERIFY - 1)])


def generate_predicted(llm, prompt: list[int], prediction: list[int], sampling, max_new: int):
    """Plain decoding that drafts from the caller's predicted output where the output follows
    it, each draft verified by the target in one batch (the speculative loop without a draft
    model), priced without this machine's table at the dearest verification measured
    anywhere: what mode plain runs when given a prediction (engine/plain.py)."""
    from .context_drafter import ContextSource, free_draft_max
    from .decode import generate_spec

    context = ContextSource(None, prediction=Prediction(prediction),
                            follow_max=free_draft_max(sampling), is_eog=llm.model.is_eog)
    return generate_spec(llm.tgt.seq, None, prompt, 0, sampling, context=context,
                         max_new=max_new, is_eog=llm.model.is_eog)

"""Replay profiled speculative rounds under any draft-length policy and cost model.

A round profiled at gamma G records the draft's top-1 probability and entropy for each of
its G tokens and how many the target accepted. Under greedy decoding the acceptance of the
first g tokens depends only on those tokens, so a policy that drafts d <= G tokens in that
round gets min(accepted, d) + 1 tokens for d * draft_cost + verify(d + 1) seconds (a plain
step: 1 token for the plain token time). Replaying every recorded round in order, each as one
decision, gives the speed a policy would reach on a machine with those costs: the GPU-like
simulation table uses it with a GPU's cost shape and the acceptance of our CPU profiles.
The approximation: rounds keep their recorded boundaries whatever the policy drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .cost import CostModel
from .acceptance import rounds_by_run
from .policies import DraftPolicy, Outcome


@dataclass(frozen=True)
class Replay:
    tokens: float
    seconds: float
    rounds: int
    drafted: int
    accepted: int
    plain_tps: float

    @property
    def speedup(self) -> float:
        return self.tokens / self.seconds / self.plain_tps

    @property
    def mean_gamma(self) -> float:
        return self.drafted / self.rounds if self.rounds else 0.0


def replay(records: list[dict], make: Callable[[], DraftPolicy], costs: CostModel) -> Replay:
    """Replay the rounds of the largest profiled gamma of each run with a fresh policy per
    run (``make()``)."""
    runs = rounds_by_run(records)
    g_max = {}
    for (pid, gamma, quant, bpw) in runs:
        g_max[(pid, quant)] = max(g_max.get((pid, quant), 0), gamma)
    tokens = seconds = 0.0
    n_rounds = drafted = accepted = 0
    v = costs.verify
    for (pid, gamma, quant, bpw), rounds in runs.items():
        if gamma != g_max[(pid, quant)]:
            continue
        policy = make()
        for r in rounds:
            g = min(policy.plan(), r["gamma"])
            d = dropped = 0
            for i in range(g):
                if policy.needs_confidence and not policy.keep(i, r["draft_top1"][i],
                                                               r["draft_entropy"][i]):
                    dropped = 1   # drafted, then dropped by keep(): its draft cost is spent
                    break
                d = i + 1
                if i + 1 < g and not policy.more(i):
                    break
            a = min(r["n_accept"], d)
            spent = d + dropped
            t = costs.draft(spent) + v(d + 1) if g else costs.plain
            tokens += a + 1
            seconds += t
            n_rounds += 1
            drafted += d
            accepted += a
            policy.update(Outcome(d, a, r["draft_top1"][:d], r["draft_entropy"][:d], t,
                                   tried=g > 0))
    return Replay(tokens, seconds, n_rounds, drafted, accepted, 1.0 / costs.plain)


def gpu_like(costs: CostModel, bpw: float, ref_bpw: float = 4.85, draft_ratio: float = 0.1,
             slope: float = 0.02) -> CostModel:
    """A GPU-like cost shape around this machine's single-token target time: verifying n
    tokens costs 1 + slope * (n - 1) target tokens (memory-bound: nearly flat), and a draft
    token costs ``draft_ratio`` of a ``ref_bpw`` target token, so the ratio grows as the
    target is compressed further (a smaller target reads fewer bytes per token)."""
    v1 = costs.plain
    return CostModel([v1 * (1 + slope * i) for i in range(16)],
                     draft_ratio * v1 * ref_bpw / bpw, key="gpu-like", plain_token_s=v1)

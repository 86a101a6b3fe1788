"""Which layers to probe for the next token (SpecEE's scheduler, plus a cost check).

SpecEE: the offline layer set (profiled: layers whose exit rate is above average) united with
{e-2, e, e+2} for the exit layer e of each of the last ``window`` tokens; never the last
layer. Beyond SpecEE: a layer is skipped when the expected saving of probing it, P(exit there)
x layers saved x cost of a layer, is below the measured cost of a probe.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def offline_layers(exit_rate: dict[int, float]) -> list[int]:
    """SpecEE's offline schedule: the layers whose exit rate is above the mean of the layers
    that exit at all."""
    positive = [r for r in exit_rate.values() if r > 0]
    mean = sum(positive) / len(positive) if positive else 0.0
    return [l for l, r in exit_rate.items() if r > 0 and r >= mean]


@dataclass
class Scheduler:
    n_layer: int
    offline: list[int]
    window: int = 5
    spread: tuple[int, ...] = (-2, 0, 2)
    allowed: set[int] | None = None        # layers that have a predictor
    exit_rate: dict[int, float] = field(default_factory=dict)  # P(exit at l), calibration
    layer_cost: float = 0.0                 # seconds per layer per token
    probe_cost: float = 0.0                 # seconds per probe (segment + predictor)
    recent: deque = field(default_factory=deque)

    def layers(self, n_rows: int = 1) -> list[int]:
        """Layers to probe for the next token (or a batch of ``n_rows`` that exits only
        together: spec_ee/), ascending. A batch's exit chance at a layer is taken as the
        token's to the power ``n_rows`` (rows taken as independent, which undercounts easy
        stretches where they are not); costs per row and savings per row scale alike."""
        want = set(self.offline)
        for e in self.recent:
            want.update(e + d for d in self.spread)
        out = []
        for l in sorted(want):
            if not 1 <= l < self.n_layer - 1:
                continue
            if self.allowed is not None and l not in self.allowed:
                continue
            if self.probe_cost > 0 and self.layer_cost > 0:
                saving = (self.exit_rate.get(l, 0.0) ** n_rows * (self.n_layer - l)
                          * self.layer_cost)
                if saving < self.probe_cost:
                    continue
            out.append(l)
        return out

    def record(self, exit_layer: int | None) -> None:
        """Remember where the last token exited (None: it ran to the end)."""
        if exit_layer is None:
            return
        self.recent.append(exit_layer)
        while len(self.recent) > self.window:
            self.recent.popleft()

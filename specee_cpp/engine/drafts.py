"""What every loop that verifies drafted tokens shares (the speculative loop, early exit's
steps with a prediction): how many tokens a round may draft, and greedy acceptance."""
from __future__ import annotations

from typing import Callable


def draft_room(max_new: int | None, n_emitted: int) -> int | None:
    """The most tokens a round may draft when ``n_emitted`` of at most ``max_new`` tokens are
    out (None: no limit). A round emits its accepted drafts and one token more: drafting past
    the limit would pay to verify tokens that are never emitted."""
    return None if max_new is None else max(0, max_new - n_emitted - 1)


def accept_greedy(draft: list[int], target_at: Callable[[int], int]) -> tuple[int, int]:
    """Greedy verification: (drafted tokens equal to the target's argmax, the target's token
    after them). ``target_at(i)`` is the target's greedy token after drafted prefix i; it is
    asked only up to the first mismatch."""
    for i, tok in enumerate(draft):
        best = target_at(i)
        if tok != best:
            return i, best
    return len(draft), target_at(len(draft))

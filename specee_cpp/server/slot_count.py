"""How many requests ``serve`` decodes at once where ``--parallel`` is not given.

Slots pay by batching (engine/slot_step.py times by how much on this machine). They cost a
KV cache of n_ctx tokens each and, in a full step, a slower token for each request. And a
slot's default (gamma auto) runs no draft model: its costs were measured for one request at
a time, so where the draft model pays on this machine, one request at a time keeps it.

So the default is ``SLOT_DEFAULT`` slots (llama-server's default count) where this machine's
timing of such a step gives at least ``SLOT_GAIN`` times the tokens a second of one request
at a time, and where the configuration runs unchanged in a slot; else one. Whether the
default pair's draft model pays comes from the pair's cost table: where it is not measured
yet, the server runs one slot and measures it while idle, and a later start decides.
"""
from __future__ import annotations

from ..config import SLOT_DEFAULT, SLOT_GAIN
from ..engine.slot_step import gain, pays, step_timing


def draft_pays(llm) -> bool | None:
    """Whether the loaded pair's draft model pays on this machine, by its cost table (for
    ``NAME:auto``, the variant chosen here); None where that is not measured yet."""
    from ..speculative.mode import measured_costs
    from ..speculative.variants import model_drafting_pays, remembered_choice

    if llm.draft_auto and remembered_choice(llm) is None:
        return None
    table = measured_costs(llm)
    return None if table is None else model_drafting_pays(table)


def default_slots(llm, alone, in_slot, opts, draft_given: bool) -> tuple[int, str]:
    """(slots, why) for serving ``llm`` where ``--parallel`` is not given: with mode
    ``alone`` one request at a time, else mode ``in_slot`` with ``opts`` in each slot;
    ``draft_given``: the command names a draft model (which only one slot runs)."""
    n = SLOT_DEFAULT
    if why := in_slot.refused_with_slots(n, opts, draft=draft_given):
        return 1, why
    if draft_given:
        return 1, ("--draft: a draft model runs with one request at a time unless "
                   "--parallel N asks for slots (then at a fixed --gamma N in each)")
    if llm.draft_path is not None and alone.needs_draft:
        verdict = draft_pays(llm)
        if verdict is None:
            return 1, ("whether the draft model pays on this machine is not measured yet "
                       "(measured while idle; a later start decides)")
        if verdict:
            return 1, ("the draft model pays on this machine, and a slot of several runs "
                       "none at gamma auto")
    seen, source = step_timing(llm)
    g = gain(seen)
    cost = f"a step of {n} requests costs {seen['step'] / seen['one']:.1f} one-token steps"
    if not pays(seen):
        return 1, f"{cost} here, {source}: {g:.2f}x the tokens a second, under {SLOT_GAIN}x"
    return n, f"{cost} here, {source}: {g:.1f}x the tokens a second of one at a time"

"""Which variant of the draft this machine should run (``--draft NAME:auto``).

A draft made cheaper for the kernels at hand (requantized: ``NAME:Q4_0``, whose matrices
all take llama.cpp's AMX kernels where the shipped Q4_K_M's Q5_0 rows do not; a reduced
vocabulary head: ``NAME:v16k``; both) keeps most of its acceptance, but what it saves
depends on the machine: this chooses with the machine's own costs. The acceptance of each
variant relative to the shipped draft is a property of the models, measured on dev prompts
by ``scripts/draft_variants.py`` and shipped beside the draft's controller
(``bundles/<draft>.variants.json``); the cost of each is this machine's: the shipped draft's
full cost table, and for each variant its draft token timed against the shipped one's
(cached per machine like every cost table). The variant with the highest predicted speed
over plain across a spread of acceptances wins; where even a free draft at the best of them
cannot beat plain decoding (verification alone too dear), nothing is made or measured and
the draft stays as shipped, since a cost-aware run will not draft anyway.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..config import (MODEL_DRAFT_MARGIN, NEAR_MARGIN, SCREEN_CONTEXT,
                      SCREEN_REPEATS, SCREEN_TOKENS, STEADY_RUNS, WORK_LEVELS)
from ..errors import SpeceeError
from ..paths import BUNDLE_DIR, write_text_atomic

AUTO = "auto"


def record_path(base_sha256: str) -> Path:
    return BUNDLE_DIR / f"{base_sha256[:16]}.variants.json"


def load_record(base_sha256: str) -> dict:
    """{variant: {"acceptance": float, ...}} measured on dev prompts, with "source" and
    "date"; empty where nobody measured this draft's variants."""
    try:
        return json.loads(record_path(base_sha256).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise SpeceeError(f"cannot read {record_path(base_sha256)}: {e}") from None


def predicted_speedup(costs, acceptance: float) -> tuple[float, int]:
    """(best expected speed over plain, its gamma) at this acceptance, at the table's
    first context (a chat turn's)."""
    c = costs.points[0]
    g = c.best_gamma(acceptance)
    return c.expected_tps(acceptance, g) * c.plain, g





def workload_score(costs, relative: float) -> float:
    """Mean predicted speed over plain across WORK_LEVELS, acceptance scaled by
    ``relative`` (the variant's recorded acceptance over the shipped draft's)."""
    return sum(predicted_speedup(costs, min(a * relative, 0.99))[0]
               for a in WORK_LEVELS) / len(WORK_LEVELS)


def pays_from(costs, relative: float) -> float:
    """The least acceptance of the shipped draft (in steps of 0.01, scaled by ``relative``
    like workload_score) from which drafting is predicted to beat plain decoding; 2.0 where
    none does. Equal WORK_LEVELS scores are told apart by it (see ``choose``): the variant
    that starts paying at the lowest acceptance drafts over the most of the work above the
    levels (code, rewrites)."""
    for a in np.arange(0.5, 1.0001, 0.01):
        if predicted_speedup(costs, min(a * relative, 0.99))[0] > 1.0:
            return round(float(a), 2)
    return 2.0





def drafting_margin(costs) -> float:
    """The draft model's best predicted speed over plain across WORK_LEVELS when it drafts
    (1 to MAX_GAMMA tokens, however far below plain that is), over MODEL_DRAFT_MARGIN: the
    verdict of ``model_drafting_pays`` flips at 1.0, and how far from it a table lies is
    how much its noise could move it."""
    from ..config import MAX_GAMMA
    from .cost import as_table

    c = as_table(costs).points[0]
    best = max(c.expected_tps(a, g) * c.plain for a in WORK_LEVELS
               for g in range(1, MAX_GAMMA + 1))
    return best / MODEL_DRAFT_MARGIN


def model_drafting_pays(costs) -> bool:
    """Whether drafting with the draft ``costs`` were measured for is predicted to gain at
    least MODEL_DRAFT_MARGIN over plain decoding at some acceptance of WORK_LEVELS (at the
    table's first context; a single CostModel is its own table)."""
    return drafting_margin(costs) >= 1.0


def scaled_draft(costs, ratio: float):
    """``costs`` with the draft's decodes ``ratio`` times as dear (a variant screened
    against the draft the table was measured with; verification is the target's)."""
    return replace(costs, points=[replace(p, draft_token_s=p.draft_token_s * ratio,
                                          draft_first_s=p.draft_first_s * ratio)
                                  for p in costs.points])


def choose(llm, base_name: str, status) -> str:
    """Point ``llm`` at the best variant of ``base_name`` for this machine; returns a note
    saying what was chosen and why (the stats line shows it).

    The shipped draft's full cost table is measured (once per machine, cached); each other
    variant is only screened: its draft token timed against the shipped one's, interleaved
    (``draft_ratio``, seconds a variant, cached), since verification is the target's and
    the same for all. Only the winner gets its own table, when the run reads it."""
    from ..engine.llm import resolve
    from .mode import base_sha256, cost_model

    rec = load_record(base_sha256(llm))
    variants = rec.get("variants", {})
    if not variants:
        return f"draft {base_name} as shipped (no measured variants for it)"
    shipped_spec = str(rec.get("shipped", ""))
    shipped = cost_model(llm)
    ref_a = variants.get(shipped_spec, {}).get("acceptance") or max(
        v["acceptance"] for v in variants.values())   # for records without relative rates
    # a variant's acceptance against the shipped draft's measured in the same run (another
    # machine's run gives other greedy text, other absolute rates)
    rel = {spec: v.get("relative_to_shipped") or v["acceptance"] / ref_a
           for spec, v in variants.items()}
    rel.setdefault(shipped_spec, 1.0)
    free = scaled_draft(shipped, 0.0)
    top = min(WORK_LEVELS[-1] * max(rel.values()), 0.99)
    if predicted_speedup(free, top)[0] <= 1.0:
        return (f"draft {base_name} as shipped: even a free draft at acceptance {top:.2f} "
                f"cannot beat plain decoding on this machine's verification costs")

    def path_of(spec: str) -> Path:
        if spec.upper() == shipped_spec.upper():
            return llm.draft_base_path      # the registry file itself, not a copy of it
        return resolve(f"{base_name}:{spec}")

    # most accepting first: a variant that could not beat the best so far even with a free
    # draft is neither made nor timed (a low-acceptance head cut on a CPU, say)
    ratios = {shipped_spec: 1.0}
    scores = {shipped_spec: workload_score(shipped, rel[shipped_spec])}
    starts = {shipped_spec: pays_from(shipped, rel[shipped_spec])}
    failed = []
    for spec in sorted(variants, key=lambda k: -rel[k]):
        if spec in ratios or (workload_score(free, rel[spec]) <= max(scores.values())
                              and pays_from(free, rel[spec]) >= min(starts.values())):
            continue
        try:
            with status(f"making draft variant {base_name}:{spec} (once)"):
                path = path_of(spec)
            with status(f"timing draft variant {base_name}:{spec} against the shipped one "
                        f"(once)"):
                ratios[spec] = draft_ratio(llm, path)
        except (SpeceeError, OSError) as e:
            # an optional candidate (a type this build cannot make, a full disk): the
            # others still compete, and the note says what was left out
            failed.append(f"{spec}: {e}")
            continue
        costs = scaled_draft(shipped, ratios[spec])
        scores[spec] = workload_score(costs, rel[spec])
        starts[spec] = pays_from(costs, rel[spec])
    def pick(ratios: dict) -> str:
        # equal scores (most often all 1.00: nothing pays at the work levels) go to the
        # variant that starts paying at the lowest acceptance, then to the shipped draft.
        # Decided by the shipped one alone, the Zen 5 EPYC's choice flipped on its table's
        # noise: the shipped draft at 0.67 of a target token (build c763be6b) paid nowhere
        # and the run drafted nothing, where the IQ4_NL 16k-head one (0.49 of it) ran
        # HumanEval at 1.26-1.29x. A score at one top level instead was a coin toss between
        # that one and the full-head IQ4_NL (0.76 of it, acceptance 0.98x): 1.077x against
        # 1.098x predicted at the shipped draft's acceptance 1.0, 1.011x against 1.000x at
        # 0.95
        rank = {}
        for k, r in ratios.items():
            costs = scaled_draft(shipped, r)
            rank[k] = (round(workload_score(costs, rel[k]), 6), -pays_from(costs, rel[k]),
                       k == shipped_spec)
        return max(rank, key=rank.get)

    def swung(ratios: dict, win: str, rival: str) -> dict:
        # the two screenings moved apart by NEAR_MARGIN: the winner's dearer, the rival's
        # cheaper (the shipped draft is the screen's reference, its ratio 1 by definition)
        h = NEAR_MARGIN / 2
        return {k: r * (1 + h if k == win else 1 - h if k == rival else 1.0)
                if k != shipped_spec else r for k, r in ratios.items()}

    spec = pick(ratios)
    near = [k for k in ratios if k != spec and pick(swung(ratios, spec, k)) == k]
    if near:
        # a choice that a screening's noise could turn: its contenders are screened twice
        # more and each taken at the median of its three, so that two measurements on one
        # machine choose alike
        for k in sorted({spec, *near} - {shipped_spec}):
            with status(f"timing draft variant {base_name}:{k} again (its choice is near "
                        f"another's)"):
                ratios[k] = draft_ratio(llm, path_of(k), runs=STEADY_RUNS)
            costs = scaled_draft(shipped, ratios[k])
            scores[k], starts[k] = workload_score(costs, rel[k]), pays_from(costs, rel[k])
        spec = pick(ratios)
    set_draft(llm, path_of(spec))
    return (f"{base_name}:{spec} for this machine (draft token {ratios[spec]:.2f}x, acceptance "
            f"{rel[spec]:.2f}x the shipped draft's; predicted {scores[spec]:.2f}x plain, "
            f"shipped {scores[shipped_spec]:.2f}x"
            + (f"; pays from the shipped draft's acceptance {starts[spec]:.2f}"
               if starts[spec] <= 1.0 else "") + ")"
            + (f"; not tried: {'; '.join(failed)}" if failed else ""))




def draft_ratio(llm, path: Path, runs: int = 1) -> float:
    """Seconds of the draft variant ``path``'s decodes over the loaded draft's, each sample
    paired with one of the loaded draft's timed right after it (a neighbour slowing the
    machine slows both); the median of the pairs. ``runs``: screenings to take the median
    of (those missing are taken). Cached per machine with the cost tables (one file per
    loaded draft, each variant file's screenings)."""
    from ..provenance import machine, machine_id
    from .cost import MEASURE_VERSION, cache_path

    where = machine(llm.config.threads)
    key = f"screen-{llm.draft_sha256()[:12]}-m{machine_id(where)}-v{MEASURE_VERSION}"
    cache = cache_path(key)
    try:
        cached = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    seen = cached.get(path.name)
    seen = [seen] if isinstance(seen, (int, float)) else seen if isinstance(seen, list) else []
    seen = [float(x) for x in seen if isinstance(x, (int, float))]
    while len(seen) < runs:
        seen.append(_screen(llm, path))
        cached[path.name] = seen if len(seen) > 1 else seen[0]
        write_text_atomic(cache, json.dumps(cached, indent=1))
    return float(np.median(seen))


def _screen(llm, path: Path) -> float:
    """One screening of ``draft_ratio``: the median of SCREEN_REPEATS pairs."""
    from ..config import COST_PROMPT
    from ..engine.llm import _Loaded

    ref = llm.dft.seq
    tokens = llm.prompt_tokens(COST_PROMPT)
    context = (tokens * (SCREEN_CONTEXT // len(tokens) + 1))[:SCREEN_CONTEXT]

    def timed(seq) -> float:
        t0 = time.perf_counter()
        for t in context[:SCREEN_TOKENS]:
            seq.decode([t])
            # read as a greedy round reads each draft token: a full head costs more to read
            seq.confidence()
        dt = time.perf_counter() - t0
        seq.rewind(len(context))
        return dt

    ref.prefill(context, read=False)
    timed(ref)                                  # warm-up
    other = _Loaded(path, llm.config, llm.draft_flash_attn)   # timed as the draft runs
    try:
        other.seq.prefill(context, read=False)
        timed(other.seq)
        pairs = [timed(other.seq) / timed(ref) for _ in range(SCREEN_REPEATS)]
    finally:
        other.close()
    return float(np.median(pairs))


def choice_path(llm) -> Path:
    """Where this machine's choice of variant for the loaded base draft is kept."""
    from ..provenance import machine, machine_id
    from .cost import MEASURE_VERSION, cache_path
    from .mode import base_sha256

    where = machine(llm.config.threads)
    return cache_path(f"variant-{base_sha256(llm)[:12]}-m{machine_id(where)}"
                      f"-v{MEASURE_VERSION}")


def remember_choice(llm, note: str) -> None:
    """Keep the variant ``llm`` now drafts with as this machine's choice, with its note."""
    write_text_atomic(choice_path(llm), json.dumps({"draft": str(llm.draft_path),
                                                    "note": note}))


def remembered_choice(llm) -> str | None:
    """Point ``llm`` at the variant this machine chose before (``remember_choice``) and
    return its note; None where none was chosen here (or its file is gone)."""
    try:
        data = json.loads(choice_path(llm).read_text(encoding="utf-8"))
        path = Path(data["draft"])
        if not path.is_file():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    set_draft(llm, path)
    return f"{data.get('note', path.name)} (chosen earlier on this machine)"


def set_draft(llm, path: Path) -> None:
    """Use the draft file ``path`` (same base model) from now on: the loaded draft and the
    cached costs of the previous one are dropped."""
    from .mode import forget_costs

    if llm.draft_path == path:
        return
    llm.release_draft()
    llm.draft_path = path
    forget_costs(llm)

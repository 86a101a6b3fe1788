"""Which variant of the draft this machine should run (``--draft NAME:auto``).

A draft made cheaper for the kernels at hand (requantized: ``NAME:IQ4_NL``; a reduced
vocabulary head: ``NAME:v16k``; both) keeps nearly all of its acceptance, but what it saves
depends on the machine: this chooses with the machine's own costs. The acceptance of each
variant is a property of the models, measured once on dev prompts by
``scripts/draft_variants.py`` and shipped beside the draft's controller
(``bundles/<draft>.variants.json``); the cost of each is this machine's, measured by the cost
model (cached per machine like every cost table). The variant with the highest predicted
speed over plain wins; where even a free draft at the best recorded acceptance cannot beat
plain decoding (verification alone too dear), nothing is made or measured and the draft stays
as shipped, since a cost-aware run will not draft anyway.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import SpeceeError
from ..paths import BUNDLE_DIR

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


def choose(llm, base_name: str, status) -> str:
    """Point ``llm`` at the best variant of ``base_name`` for this machine; returns a note
    saying what was chosen and why (the stats line shows it)."""
    from ..engine.llm import resolve
    from .mode import base_sha256, cost_model

    rec = load_record(base_sha256(llm))
    variants = rec.get("variants", {})
    if not variants:
        return f"draft {base_name} as shipped (no measured variants for it)"
    shipped = cost_model(llm)
    best_a = max(v["acceptance"] for v in variants.values())
    free = replace(shipped, points=[replace(p, draft_token_s=0.0, draft_first_s=0.0)
                                    for p in shipped.points])
    if predicted_speedup(free, best_a)[0] <= 1.0:
        return (f"draft {base_name} as shipped: even a free draft at acceptance {best_a:.2f} "
                f"cannot beat plain decoding on this machine's verification costs")
    def path_of(spec: str) -> Path:
        if spec.upper() == str(rec.get("shipped", "")).upper():
            return llm.draft_base_path      # the registry file itself, not a copy of it
        return resolve(f"{base_name}:{spec}")

    scores = {}
    for spec, v in variants.items():
        with status(f"measuring draft variant {base_name}:{spec} on this machine (once)"):
            set_draft(llm, path_of(spec))
            scores[spec] = predicted_speedup(cost_model(llm), v["acceptance"])
    spec = max(scores, key=lambda k: scores[k][0])
    set_draft(llm, path_of(spec))
    speed, g = scores[spec]
    return (f"draft {base_name}:{spec}, predicted {speed:.2f}x plain at gamma {g} "
            f"(acceptance {variants[spec]['acceptance']:.2f}, this machine's costs)")


def set_draft(llm, path: Path) -> None:
    """Use the draft file ``path`` (same base model) from now on: the loaded draft and the
    cached costs of the previous one are dropped."""
    if llm.draft_path == path:
        return
    llm.release_draft()
    llm.draft_path = path
    llm.forget(("spec", "costs"))

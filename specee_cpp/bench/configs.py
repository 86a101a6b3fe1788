"""Named benchmark configurations: our modes and the peers a user would pick instead.

Peers run with the same models, threads and greedy decoding:
- ``lcpp-*``: llama.cpp's `llama-speculative-simple` (draft model, or its n-gram speculation
  types) and `llama-lookup` (prompt n-grams, optionally a static n-gram cache), built from
  the pinned sources by ``scripts/build_peers.py``;
- ``pld``: llama-cpp-python's ``LlamaPromptLookupDecoding`` with its defaults.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import FIXED_GAMMAS
from ..early_exit.mode import EEOptions
from ..engine import modes
from ..errors import SpeceeError
from ..spec_ee.mode import SpecEEOptions
from ..speculative.mode import SpecOptions


@dataclass(frozen=True)
class BenchConfig:
    name: str
    kind: str                       # ours | llama.cpp | pld
    lossless: bool                  # greedy output should equal plain's
    mode: str = "plain"             # ours: a registered mode
    options: Any = None             # ours: the mode's options (None: its defaults)
    tool: str = ""                  # llama.cpp binary
    args: tuple[str, ...] = ()      # its speculative options
    needs_draft: bool = False
    static_cache: bool = False      # llama-lookup with a static n-gram cache
    reference: bool = False         # a plain-decoding reference, not a speculative peer
    # ours: the prompt's prediction ("own"), another prompt's ("unrelated", the control of
    # what a wrong prediction costs) or none ("")
    prediction: str = ""

    @property
    def mode_options(self):
        return self.options if self.options is not None else modes.get(self.mode).Options()

    @property
    def describe(self) -> str:
        if self.kind == "ours":
            m = modes.get(self.mode)
            given = {"own": " with the prompt's prediction",
                     "unrelated": " with another prompt's prediction (control)"}
            return m.describe(self.mode_options) + given.get(self.prediction, "")
        if self.kind == "pld":
            return "llama-cpp-python LlamaPromptLookupDecoding()"
        return " ".join([self.tool, *self.args] + (["-md DRAFT"] if self.needs_draft else [])
                        + (["-lcs STATIC"] if self.static_cache else []))


def _spec_simple(name: str, *args: str, draft: bool = False) -> BenchConfig:
    return BenchConfig(name, "llama.cpp", True, tool="llama-speculative-simple", args=args,
                       needs_draft=draft)


@dataclass(frozen=True)
class SpecBenchOptions(SpecOptions):
    """Mode spec with two switches that exist only to measure what they do, in the same run
    as the default: ``correction`` (auto's round model scaled by what its rounds reached,
    ``speculative.acceptance.Correction``) and ``model_scale`` (the draft model's
    verification priced by what batches are seen to cost, ``speculative.cost.VerifyScale``)."""

    correction: bool = True
    model_scale: bool = True


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in [
    BenchConfig("plain", "ours", True),
    *[BenchConfig(f"spec-{g}", "ours", True, mode="spec", options=SpecOptions(gamma=g),
                  needs_draft=True) for g in FIXED_GAMMAS],
    # draft-length policies (speculative.policies): ours and the baselines, all lossless
    *[BenchConfig(f"spec-{p}", "ours", True, mode="spec", options=SpecOptions(gamma=p),
                  needs_draft=True) for p in ("auto", "stop", "pmin", "hf", "speckv")],
    # auto without the free drafts from the context: the draft model's part alone
    BenchConfig("spec-auto-model", "ours", True, mode="spec",
                options=SpecOptions(gamma="auto", context=False), needs_draft=True),
    # auto with the round model's predictions as fitted, uncorrected by its rounds: the
    # same-run A/B of that correction
    BenchConfig("spec-auto-raw", "ours", True, mode="spec",
                options=SpecBenchOptions(gamma="auto", correction=False), needs_draft=True),
    # auto with the draft model's rounds priced by the cost table as measured, not by what
    # batches are seen to cost (cost.VerifyScale): the same-run A/B of that scale
    BenchConfig("spec-auto-table", "ours", True, mode="spec",
                options=SpecBenchOptions(gamma="auto", model_scale=False), needs_draft=True),
    # predicted outputs (OpenAI's prediction): an edit's original, and the control where
    # the prediction is another prompt's
    BenchConfig("plain-pred", "ours", True, prediction="own"),
    BenchConfig("plain-pred-unrelated", "ours", True, prediction="unrelated"),
    BenchConfig("spec-auto-pred", "ours", True, mode="spec", options=SpecOptions(gamma="auto"),
                needs_draft=True, prediction="own"),
    BenchConfig("spec-auto-pred-unrelated", "ours", True, mode="spec",
                options=SpecOptions(gamma="auto"), needs_draft=True, prediction="unrelated"),
    # The defaults (ee, ee-draft, spec-ee) run as a user gets them: ee decodes plainly where
    # its exits cannot pay on this machine. Every other ee configuration probes anyway
    # (--probe-always) to measure its exits; ee checks each one, so all are lossless.
    BenchConfig("ee", "ours", True, mode="ee", options=EEOptions(), needs_draft=True),
    BenchConfig("ee-draft", "ours", True, mode="ee", options=EEOptions(provider="draft"),
                needs_draft=True),
    # the default's exits measured where they do not pay: probing anyway
    BenchConfig("ee-draft-probed", "ours", True, mode="ee",
                options=EEOptions(provider="draft", always=True), needs_draft=True),
    BenchConfig("ee-ngram", "ours", True, mode="ee",
                options=EEOptions(provider="ngram", always=True)),
    BenchConfig("ee-draft-cand", "ours", True, mode="ee",
                options=EEOptions(provider="draft", rule="candidate", always=True),
                needs_draft=True),
    BenchConfig("ee-ngram-cand", "ours", True, mode="ee",
                options=EEOptions(provider="ngram", rule="candidate", always=True)),
    # the same as a user gets it (no --probe-always): probing only the layers that pay on
    # this machine's costs
    BenchConfig("ee-ngram-cand-priced", "ours", True, mode="ee",
                options=EEOptions(provider="ngram", rule="candidate")),
    # the same at looser quality targets (more exits, more of them undone by the check), and
    # with the one 0.5 threshold of SpecEE's rule at every layer
    *[BenchConfig(f"ee-{p}-e{t:02d}", "ours", True, mode="ee",
                  options=EEOptions(provider=p, max_exit_error=t / 100, always=True),
                  needs_draft=p == "draft")
      for t in (2, 5) for p in ("draft", "ngram")],
    # hyper-token exit in speculative verification (gamma 4), at two quality targets
    BenchConfig("spec-ee", "ours", False, mode="spec-ee", options=SpecEEOptions(),
                needs_draft=True),
    BenchConfig("spec-ee-e05", "ours", False, mode="spec-ee",
                options=SpecEEOptions(max_exit_error=0.05, unsafe=True), needs_draft=True),
    *[BenchConfig(f"ee-{p}-t05", "ours", True, mode="ee",
                  options=EEOptions(provider=p, threshold=0.5, always=True),
                  needs_draft=p == "draft")
      for p in ("draft", "ngram")],
    _spec_simple("lcpp-draft-4", "--spec-type", "draft-simple", "--spec-draft-n-max", "4",
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", draft=True),
    _spec_simple("lcpp-draft-8-p75", "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.75", draft=True),
    _spec_simple("lcpp-ngram-simple", "--spec-type", "ngram-simple"),
    _spec_simple("lcpp-ngram-map-k", "--spec-type", "ngram-map-k"),
    _spec_simple("lcpp-ngram-cache", "--spec-type", "ngram-cache"),
    # upstream's strongest n-gram drafter, and the n-gram map with values of several tokens
    _spec_simple("lcpp-ngram-mod", "--spec-type", "ngram-mod"),
    _spec_simple("lcpp-ngram-map-k4v", "--spec-type", "ngram-map-k4v"),
    # llama.cpp's own plain decoding (llama-lookup drafting nothing): the reference for how
    # far llama.cpp's tools and ours differ numerically (batch shapes, KV size)
    BenchConfig("lcpp-plain", "llama.cpp", True, tool="llama-lookup",
                args=("--spec-draft-n-max", "0"), reference=True),
    BenchConfig("lcpp-lookup", "llama.cpp", True, tool="llama-lookup",
                args=("--spec-draft-n-max", "4")),
    BenchConfig("lcpp-lookup-static", "llama.cpp", True, tool="llama-lookup",
                args=("--spec-draft-n-max", "4"), static_cache=True),
    BenchConfig("pld", "pld", True),
]}

PEERS = [n for n, c in CONFIGS.items() if c.kind != "ours"]
# A run costs about configurations x prompts x (prefill + new tokens): 18 prompts x 64
# tokens is ~1.5 min per configuration on 2 cores, so the quick set (under 10 min there)
# keeps our lossless and our fastest lossy mode and the fastest peer of each family in the
# full run (docs/BENCHMARKS.md).
GROUPS = {
    "quick": ["plain", "spec-auto", "ee-ngram-cand", "lcpp-draft-8-p75", "lcpp-lookup", "pld"],
    "peers": PEERS,
    "all": list(CONFIGS),
}


def select(spec: str) -> list[BenchConfig]:
    """Configurations for a comma-separated list of names or groups (quick, peers, all);
    plain is always run, first."""
    names: list[str] = []
    for n in (s.strip() for s in spec.split(",")):
        if not n:
            continue
        group = GROUPS.get(n)
        if group is None and n not in CONFIGS:
            raise SpeceeError(f"unknown configuration {n!r}; valid: "
                              f"{', '.join(CONFIGS)} (groups: {', '.join(GROUPS)})")
        names.extend(group or [n])
    ordered = ["plain"] + [n for n in dict.fromkeys(names) if n != "plain"]
    return [CONFIGS[n] for n in ordered]

"""The mode registry: every mode is looked up by name with typed options; a new mode plugs
in with one class and one registration, and runs through LLM.stream like the built-ins."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

import specee_cpp
from specee_cpp.early_exit.mode import EEOptions
from specee_cpp.engine import modes
from specee_cpp.engine.plain import generate_plain
from specee_cpp.engine.steps import Step, Transcript
from specee_cpp.errors import SpeceeError
from specee_cpp.speculative.mode import SpecOptions, parse_gamma


def test_builtin_modes_are_registered_without_loading_the_library():
    import subprocess
    import sys

    code = ("import sys, specee_cpp; from specee_cpp.engine import modes; "
            "print(modes.names(), 'llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['plain', 'spec', 'ee', 'spec-ee'] False"
    assert modes.get("ee").lossless and not modes.get("spec-ee").lossless
    assert modes.get("spec").needs_draft
    with pytest.raises(SpeceeError, match="unknown mode 'fast'; modes: plain, spec, ee"):
        modes.get("fast")


def test_options_are_typed():
    assert SpecOptions().gamma == "auto" and SpecOptions(gamma=4).gamma == 4
    assert parse_gamma(" 6 ") == 6 and parse_gamma("Auto") == "auto"
    for bad in ("4", "often", -1, True, 2.5):
        with pytest.raises(SpeceeError, match="gamma must be"):
            SpecOptions(gamma=bad)
    assert str(EEOptions(predictors="x/b.npz").predictors) == "x/b.npz"
    with pytest.raises(SpeceeError, match="option 'gamma' does not apply to mode ee"):
        modes.get("ee").options(gamma=4)
    with pytest.raises(SpeceeError, match="its options: none"):
        modes.get("plain").options(threshold=0.5)


@dataclass(frozen=True)
class EveryOther:
    keep: int = 2


class Decimate(modes.Mode):
    """A toy mode: plain decoding that reports every ``keep``-th token as an exit."""

    name = "decimate-test"
    Options = EveryOther

    def start(self, llm, sampling, opts):
        from specee_cpp.engine.sampling import make_picker

        def run(tokens, max_new):
            for i, step in enumerate(generate_plain(llm.tgt.seq, tokens, make_picker(sampling))):
                yield Step(token=step.token, timings=step.timings,
                           exit_layer=0 if i % opts.keep == 0 else None)

        return run


def test_a_new_mode_plugs_in_with_one_registration(tiny_llama):
    mode = modes.register(Decimate())
    try:
        assert "decimate-test" in modes.names()
        with specee_cpp.load(str(tiny_llama), n_ctx=128, n_threads=1) as llm:
            plain = llm.generate("the cat", max_tokens=6, chat=False)
            by_name = llm.generate("the cat", max_tokens=6, chat=False, mode="decimate-test",
                                   keep=3)
            by_object = llm.generate("the cat", max_tokens=6, chat=False, mode=mode,
                                     options=EveryOther(3))
            assert by_name.tokens == by_object.tokens == plain.tokens
            assert sum(by_name.stats.exit_layers.values()) == 2      # tokens 0 and 3
            with pytest.raises(SpeceeError, match="takes EveryOther, got SpecOptions"):
                llm.generate("x", max_tokens=2, mode=mode, options=SpecOptions())
            with pytest.raises(SpeceeError, match="either as options= or as keywords"):
                llm.generate("x", max_tokens=2, mode=mode, options=EveryOther(), keep=2)
            with pytest.raises(SpeceeError, match="mode spec needs a draft model"):
                llm.generate("x", max_tokens=2, mode="spec", gamma=2)
        with pytest.raises(SpeceeError, match="already registered"):
            class Other(modes.Mode):
                name = "plain"
            modes.register(Other())
    finally:
        modes.unregister("decimate-test")


def test_transcript_keeps_text_tokens_and_stats():
    from specee_cpp.engine.steps import Stats

    t = Transcript()
    t.add(Step(token=1, text="a"))
    stats = Stats(n_prompt=1, n_gen=1, prefill_s=0.1, decode_s=0.0, finish_reason="stop")
    t.add(Step(token=2, text="", finish_reason="stop", stats=stats))   # end of generation
    r = t.result()
    assert (r.text, r.tokens, r.stats) == ("a", [1], stats)

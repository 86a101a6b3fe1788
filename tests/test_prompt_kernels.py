"""Prompt batches (above the 64 rows of a verification) take the patched row kernels only
where they were timed faster on the machine: measured with the cost table, cached per model
and machine, set again at every load; a switch set by hand is left alone."""
from __future__ import annotations

import json

import pytest

import specee_cpp
from specee_cpp.bindings import kernel_switch, set_kernel_switch
from specee_cpp.engine import prompt_kernels as pk

pytestmark = pytest.mark.skipif(kernel_switch("REPACK_ROWS") is None,
                                reason="no kernel switches in this library")


def test_which_switches_read_a_targets_prompts():
    x86 = "AVX2 = 1 | REPACK = 1"
    assert pk.candidates(frozenset({"Q4_K", "Q6_K"}), x86, False) == ["REPACK_ROWS", "Q6_K_ROWS"]
    assert pk.candidates(frozenset({"Q4_K", "Q6_K"}), x86, True) == ["AMX_FUSED_ROWS"]
    assert pk.candidates(frozenset({"Q4_0", "Q8_0"}), x86, True) == []
    assert pk.candidates(frozenset({"Q6_K"}), "AVX2 = 1 | REPACK = 0", False) == ["Q6_K_ROWS"]
    assert pk.candidates(frozenset({"Q4_K"}), "AVX2 = 1 | REPACK = 0", False) == []
    assert pk.candidates(frozenset({"Q4_K", "Q6_K"}), "NEON = 1", False) == []


def test_ours_only_past_the_margin():
    assert pk.choose({"ours": 0.90, "upstream": 1.0})
    assert not pk.choose({"ours": 0.99, "upstream": 1.0})   # within noise: upstream's
    assert not pk.choose({"ours": 1.10, "upstream": 1.0})


@pytest.fixture
def q4k_model(tmp_path_factory):
    from kernel_checks import make_model

    return make_model(tmp_path_factory.mktemp("pk"), "Q4_K")


def test_measured_once_then_read_and_set_at_load(q4k_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    monkeypatch.setenv("SPECEE_CPP_AMX", "0")
    monkeypatch.delenv("SPECEE_CPP_REPACK_ROWS", raising=False)
    before = kernel_switch("REPACK_ROWS")
    try:
        with specee_cpp.load(str(q4k_model), n_ctx=256, n_threads=1) as llm:
            assert llm.prompt_kernels == {}            # nothing measured yet: upstream's
            got = pk.prompt_kernels(llm, measure=True)
            assert list(got) == ["REPACK_ROWS"] and "measured on this machine now" in \
                got["REPACK_ROWS"], got
        [cache] = (tmp_path / "costs").glob("prompt-kernels-*.json")
        seen = json.loads(cache.read_text())
        assert seen["REPACK_ROWS"]["rows"] == 128 and seen["REPACK_ROWS"]["ours"] > 0
        # a later load reads the choice and sets the switch by it
        cache.write_text(json.dumps({"REPACK_ROWS": {"ours": 0.5, "upstream": 1.0,
                                                     "rows": 128}}))
        set_kernel_switch("REPACK_ROWS", before)
        with specee_cpp.load(str(q4k_model), n_ctx=256, n_threads=1) as llm:
            assert llm.prompt_kernels["REPACK_ROWS"].startswith(
                f"ours for prompts, measured on this machine ({cache.name})")
            assert kernel_switch("REPACK_ROWS") == pk.EVERY_BATCH
        from specee_cpp.doctor import row_kernels

        [line] = [x for x in row_kernels("AVX2 = 1 | REPACK = 1", kernel_switch)
                  if x.startswith("REPACK_ROWS")]
        assert "every batch, measured here for prompts: " in line and ": ours (0.50 s" in line
        # set by hand, the switch is the user's: nothing measured, nothing set
        set_kernel_switch("REPACK_ROWS", before)
        monkeypatch.setenv("SPECEE_CPP_REPACK_ROWS", "8")
        with specee_cpp.load(str(q4k_model), n_ctx=256, n_threads=1) as llm:
            assert llm.prompt_kernels == {} and pk.prompt_kernels(llm, measure=True) == {}
        assert kernel_switch("REPACK_ROWS") == before
    finally:
        set_kernel_switch("REPACK_ROWS", before)

"""Profiling records of speculative decoding (tiny models)."""
import json

import numpy as np
import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.speculative.profile import profile
from specee_cpp.speculative.decode import draft_confidence
from specee_cpp.errors import SpeceeError
from tiny_gguf import write_tiny_model


def test_draft_confidence():
    top1, ent = draft_confidence(np.array([0.0, 0.0, 0.0, 0.0]))
    # float32 on purpose: it runs once per drafted token over the whole vocabulary
    assert top1 == 0.25 and abs(ent - np.log(4)) < 1e-6
    top1, ent = draft_confidence(np.array([100.0, 0.0]))
    assert top1 > 0.999 and ent < 1e-6


def test_profile_records_and_resume(tmp_path):
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    out = tmp_path / "prof.jsonl"
    prompts = [("qa", "the cat sat"), ("writing", "hello world")]
    with LLM(t, draft=d, config=LoadConfig(n_ctx=128, n_batch=32, n_threads=1)) as llm:
        n = profile(llm, prompts, [1, 3], max_tokens=12, out=out)
        recs = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(recs) == n > 0
        assert {(r["prompt_id"], r["gamma"]) for r in recs} == {(0, 1), (0, 3), (1, 1), (1, 3)}
        for r in recs:
            assert len(r["draft_top1"]) == len(r["draft_entropy"]) == r["gamma"]
            assert 0 <= r["n_accept"] <= r["gamma"] and r["t_verify"] > 0
            assert r["target_quant"] == "ALL_F32" and r["category"] in ("qa", "writing")
            assert abs(r["target_bpw"] - 32.0) < 0.5   # F32 weights
            # provenance: the machine the timings were taken on
            m = r["machine"]
            assert m["threads"] == 1 and m["build"] and "AVX" in m["features"] + "NEON"
        # a rerun finds everything done and writes nothing
        assert profile(llm, prompts, [1, 3], max_tokens=12, out=out) == 0
        assert len(out.read_text().splitlines()) == n
        # records from another machine or build are never mixed with this one's
        other = [dict(r, machine=dict(r["machine"], build="elsewhere")) for r in recs]
        mixed = tmp_path / "mixed.jsonl"
        mixed.write_text("".join(json.dumps(r) + "\n" for r in other))
        with pytest.raises(SpeceeError, match="another machine"):
            profile(llm, prompts, [1, 3], max_tokens=12, out=mixed)

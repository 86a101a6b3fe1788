"""The quantization ladder on tiny models (llama.cpp's quantizer through our binding)."""
import subprocess
import sys

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.errors import SpeceeError
from specee_cpp.models.gguf_info import read_gguf_info
from specee_cpp.bindings.quantize import parse_types, quantize
from tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    # rows of 64: a multiple of the 32-wide blocks of Q8_0/Q4_0 (K-quants fall back)
    return write_tiny_model(tmp_path_factory.mktemp("q") / "tiny64.gguf", n_embd=64, n_ff=128)


@pytest.mark.parametrize("qtype,file_type", [("Q8_0", "MOSTLY_Q8_0"), ("Q4_0", "MOSTLY_Q4_0"),
                                             ("IQ4_NL", "MOSTLY_IQ4_NL")])
def test_quantize_writes_a_loadable_model(tiny64, tmp_path, qtype, file_type):
    out, warning = quantize(tiny64, qtype, tmp_path)
    assert out.name == f"tiny64.{qtype}.gguf" and warning is None
    assert read_gguf_info(out).file_type == file_type
    assert out.stat().st_size < tiny64.stat().st_size
    assert not list(tmp_path.glob("*.partial"))
    with LLM(out, config=LoadConfig(n_ctx=64, n_batch=16, n_threads=1)) as llm:
        assert len(llm.generate("the cat", max_tokens=4, chat=False).tokens) == 4


def test_upward_requantization_is_flagged(tiny64, tmp_path):
    q4, _ = quantize(tiny64, "Q4_0", tmp_path)
    _, warning = quantize(q4, "Q8_0", tmp_path)
    assert "does not restore" in warning


def test_bad_types_and_cli(tiny64, tmp_path):
    with pytest.raises(SpeceeError, match="Q9_X"):
        parse_types("Q8_0,Q9_X")
    r = subprocess.run([sys.executable, "-m", "specee_cpp.cli", "quantize", str(tiny64),
                        "--types", "q8_0", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny64.Q8_0.gguf").is_file()


@pytest.mark.model
def test_name_colon_type_is_a_cached_variant(small_model, tmp_path, monkeypatch):
    """`NAME:TYPE` (a draft made cheap for this machine's kernels) is quantized once into
    the model cache and then reused."""
    from specee_cpp.engine.llm import resolve

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))   # a model cache of its own
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / small_model.name).symlink_to(small_model)
    out = resolve("smollm2-135m:q8_0")
    assert out.parent == tmp_path / "models" and read_gguf_info(out).quant == "Q8_0"
    stamp = out.stat().st_mtime_ns
    assert resolve("smollm2-135m:Q8_0") == out and out.stat().st_mtime_ns == stamp
    with pytest.raises(SpeceeError, match="unknown quantization type"):
        resolve("smollm2-135m:Q9")

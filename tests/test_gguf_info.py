import pytest

from specee_cpp.errors import ModelFileError
from specee_cpp.models.gguf_info import read_gguf_info


def test_tiny_header(tiny_llama):
    info = read_gguf_info(tiny_llama)
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 2, 32, 269)
    assert info.file_type == "ALL_F32"
    assert info.data_end == info.file_size


def test_real_small_model_header(small_model):
    info = read_gguf_info(small_model)
    assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == ("llama", 30, 576, 49152)
    assert info.quant == "Q4_1"
    assert "im_start" in info.chat_template


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        read_gguf_info(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_bytes(b"hello, this is not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_gguf_info(p)


@pytest.mark.parametrize("keep", [0.2, 0.9, 0.999])
def test_truncated(tmp_path, tiny_llama, keep):
    data = tiny_llama.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match="truncated"):
        read_gguf_info(p)


def test_tokenizer_fingerprint(tiny_llama, tiny_qwen2, tiny_other_vocab):
    same = read_gguf_info(tiny_llama).tokenizer_fingerprint
    assert read_gguf_info(tiny_qwen2).tokenizer_fingerprint == same  # same vocab, other arch
    assert read_gguf_info(tiny_other_vocab).tokenizer_fingerprint != same

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


def test_a_file_cut_anywhere_in_its_header_is_refused(tmp_path, tiny_llama):
    """Every cut inside the key-values (the vocabulary's strings among them) and the tensor
    list is one ModelFileError, never a struct or index error."""
    data = tiny_llama.read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens")
    p = tmp_path / "cut.gguf"
    for cut in [*range(8, tokens + 64), *range(tokens + 64, len(data) // 2, 97)]:
        p.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match="truncated|corrupt"):
            read_gguf_info(p)


def test_tokenizer_fingerprint(tiny_llama, tiny_qwen2, tiny_other_vocab):
    same = read_gguf_info(tiny_llama).tokenizer_fingerprint
    assert read_gguf_info(tiny_qwen2).tokenizer_fingerprint == same  # same vocab, other arch
    assert read_gguf_info(tiny_other_vocab).tokenizer_fingerprint != same


# targeted corruptions of the real small model (scripts/fuzz_gguf.py builds them), each
# refused here, before llama.cpp sees the file, with its reason
REFUSED = {
    "context_length=0": "bad llama.context_length 0",
    "context_length=2^31-1": "bad llama.context_length 2147483647",
    "duplicate-key": "key 'general.architecture' appears twice",
    "bos_id=n_vocab": "bad tokenizer.ggml.bos_token_id 49152",
    "eos_id=n_vocab": "bad tokenizer.ggml.eos_token_id 49152",
    "vocab_size+1": "bad llama.vocab_size 49153",
    "merges-cut-to-10": "merges has 10 entries",
    "type:output_norm.weight=1": "'output_norm.weight' is a vector stored as F16",
    "type:blk.0.attn_norm.weight=1": "'blk.0.attn_norm.weight' is a vector stored as F16",
    "type:output_norm.weight=26": "'output_norm.weight' is I32",
    "type:blk.0.attn_norm.weight=24": "'blk.0.attn_norm.weight' is I8",
    "type:blk.0.ffn_up.weight=2": "'blk.0.ffn_norm.weight' starts at data offset",
    "type:blk.0.ffn_up.weight=6": "'blk.0.ffn_norm.weight' starts at data offset",
    "offset:blk.0.ffn_up.weight+1": "'blk.0.ffn_up.weight' starts at data offset",
    "offset:blk.0.ffn_up.weight-32": "'blk.0.ffn_up.weight' starts at data offset",
    "duplicate-tensor": "tensor 'blk.0.ffn_up.weight' appears twice",
    "n_kv-1": "the header's key-value or tensor count may be wrong",
}


@pytest.fixture(scope="module")
def corrupted(small_model):
    from scripts_path import load_script

    fuzz = load_script("fuzz_gguf")
    return dict(fuzz.targeted(fuzz.Source(small_model)))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_targeted_corruption_is_refused_with_its_reason(corrupted, tmp_path, name):
    p = tmp_path / "bad.gguf"
    p.write_bytes(corrupted[name]())
    with pytest.raises(ModelFileError) as e:
        read_gguf_info(p)
    assert REFUSED[name] in str(e.value)


def test_a_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory"):
        read_gguf_info(tmp_path)

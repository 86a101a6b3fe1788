"""Tiny GGUF models written with the `gguf` package, for fast exact tests.

F32 weights, a byte-fallback SentencePiece vocabulary (any text tokenizes), llama-style
tensors. ``arch`` may be "llama" or "qwen2" (same tensors; qwen2 also gets q/k/v biases),
or any other string to produce a file llama.cpp cannot load.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

WORDS = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁hello", "▁world",
         "."]


def tiny_vocab(extra_words: list[str] | None = None, n_vocab: int = 0):
    """A byte-fallback SentencePiece vocabulary; ``n_vocab`` > its size pads it with
    synthetic words (a model of a real vocabulary's shape)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    words = WORDS + (extra_words or [])
    words += [f"▁w{i}" for i in range(max(0, n_vocab - len(tokens) - len(words)))]
    tokens += words
    types += [TokenType.NORMAL] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def copy_tokenizer(src: Path, w: GGUFWriter) -> int:
    """Write the tokenizer of the GGUF ``src`` into ``w`` (a random model that a real model
    accepts as its draft); returns the vocabulary size."""
    from gguf import GGUFReader

    r = GGUFReader(str(src))
    f = {k: v for k, v in r.fields.items()}

    def strings(key):
        fld = f[key]
        return [bytes(fld.parts[i]).decode("utf-8") for i in fld.data]

    def scalar(key):
        return f[key].parts[-1][0]

    tokens = strings("tokenizer.ggml.tokens")
    w.add_tokenizer_model(bytes(f["tokenizer.ggml.model"].parts[-1]).decode())
    if "tokenizer.ggml.pre" in f:
        w.add_tokenizer_pre(bytes(f["tokenizer.ggml.pre"].parts[-1]).decode())
    w.add_token_list(tokens)
    types = f["tokenizer.ggml.token_type"]
    w.add_token_types([int(types.parts[i][0]) for i in types.data])
    if "tokenizer.ggml.merges" in f:
        w.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
                     ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id)):
        if key in f:
            add(int(scalar(key)))
    if "tokenizer.chat_template" in f:
        w.add_chat_template(bytes(f["tokenizer.chat_template"].parts[-1]).decode())
    return len(tokens)


def write_tiny_model(path: Path, arch: str = "llama", n_layer: int = 2, n_embd: int = 32,
                     n_head: int = 4, n_head_kv: int = 2, n_ff: int = 64, seed: int = 0,
                     extra_words: list[str] | None = None, n_ctx_train: int = 256,
                     vocab_from: Path | None = None, n_vocab: int = 0, f16: bool = False,
                     tied: bool = False, scale: float = 0.3,
                     chat_template: str | None = None) -> Path:
    """A random-weight model; the defaults are tiny F32 test models. ``n_vocab``, ``f16``,
    ``tied`` (no output matrix: the embeddings serve as the LM head) and ``scale`` write one
    in a real model's shape instead (scripts/gpu_check.py); ``chat_template`` replaces the
    tiny vocabulary's template."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(1 if f16 else 0)  # MOSTLY_F16 / ALL_F32
    if vocab_from is not None:
        n_vocab = copy_tokenizer(vocab_from, w)
    else:
        tokens, scores, types = tiny_vocab(extra_words, n_vocab)
        n_vocab = len(tokens)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_chat_template(chat_template or (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"))

    def t(name: str, *shape: int, scale: float = scale) -> None:
        # matrices in F16 when asked; vectors (biases) stay F32, as llama.cpp writes them
        # (float32 draws for the big F16 models: half the time and memory)
        draws = rng.standard_normal(shape, dtype=np.float32) if f16 else rng.standard_normal(shape)
        dtype = np.float16 if f16 and len(shape) > 1 else np.float32
        w.add_tensor(name, (draws * scale).astype(dtype))

    def norm_weight() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    if not tied:
        t("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm_weight())
        t(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_k.weight", n_embd_kv, n_embd)
        t(f"blk.{i}.attn_v.weight", n_embd_kv, n_embd)
        if arch == "qwen3":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        if arch == "qwen2":
            t(f"blk.{i}.attn_q.bias", n_embd, scale=scale / 3)
            t(f"blk.{i}.attn_k.bias", n_embd_kv, scale=scale / 3)
            t(f"blk.{i}.attn_v.bias", n_embd_kv, scale=scale / 3)
        t(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm_weight())
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""A numpy forward pass of the tiny llama/qwen2 models in tiny_gguf.py, as the exactness
reference for the patched library: RMS norm, RoPE (normal for llama, NeoX for qwen2),
grouped-query causal attention over an explicit K/V cache, SwiGLU FFN, output head.

The K/V cache is a list (per layer) of dicts position -> (k, v), so a test can build the
cache the way an early exit must leave it: skipped layers filled from the exit residual.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader


class RefModel:
    def __init__(self, path: Path):
        r = GGUFReader(str(path))
        kv = {f.name: f for f in r.fields.values()}
        self.arch = bytes(kv["general.architecture"].parts[-1]).decode()

        def scalar(key):
            return kv[f"{self.arch}.{key}"].parts[-1][0]

        self.n_layer = int(scalar("block_count"))
        self.n_embd = int(scalar("embedding_length"))
        self.n_head = int(scalar("attention.head_count"))
        self.n_head_kv = int(scalar("attention.head_count_kv"))
        self.eps = float(scalar("attention.layer_norm_rms_epsilon"))
        self.base = float(scalar("rope.freq_base"))
        self.head_dim = self.n_embd // self.n_head
        self.w = {}
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy (rows, cols)
            self.w[t.name] = np.asarray(t.data, dtype=np.float64).reshape(shape)

    # -- pieces ---------------------------------------------------------------------------
    def norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """x: (n_tok, n_heads, head_dim); rotates by position."""
        d = self.head_dim
        inv = self.base ** (-np.arange(0, d, 2) / d)          # (d/2,)
        ang = np.asarray(pos)[:, None] * inv[None, :]          # (n_tok, d/2)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if self.arch == "qwen2":   # NeoX: pairs (i, i + d/2)
            a, b = x[..., : d // 2], x[..., d // 2:]
            out[..., : d // 2], out[..., d // 2:] = a * cos - b * sin, a * sin + b * cos
        else:                      # normal: pairs (2i, 2i + 1)
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def proj(self, name, x):
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def kv(self, il, h, pos):
        """K (roped) and V of layer il computed from the residual h entering it."""
        x = self.norm(h, self.w[f"blk.{il}.attn_norm.weight"])
        n = h.shape[0]
        k = self.proj(f"blk.{il}.attn_k", x).reshape(n, self.n_head_kv, self.head_dim)
        v = self.proj(f"blk.{il}.attn_v", x).reshape(n, self.n_head_kv, self.head_dim)
        return self.rope(k, pos), v

    def layer(self, il, h, pos, cache):
        n = h.shape[0]
        x = self.norm(h, self.w[f"blk.{il}.attn_norm.weight"])
        q = self.proj(f"blk.{il}.attn_q", x).reshape(n, self.n_head, self.head_dim)
        q = self.rope(q, pos)
        k, v = self.kv(il, h, pos)
        for i, p in enumerate(pos):
            cache[il][p] = (k[i], v[i])
        group = self.n_head // self.n_head_kv
        out = np.zeros((n, self.n_head, self.head_dim))
        for i, p in enumerate(pos):
            keys = sorted(q_ for q_ in cache[il] if q_ <= p)   # causal
            K = np.stack([cache[il][j][0] for j in keys])     # (n_kv, n_head_kv, d)
            V = np.stack([cache[il][j][1] for j in keys])
            for hh in range(self.n_head):
                s = K[:, hh // group, :] @ q[i, hh] / np.sqrt(self.head_dim)
                a = np.exp(s - s.max())
                out[i, hh] = (a / a.sum()) @ V[:, hh // group, :]
        h = h + self.proj(f"blk.{il}.attn_output", out.reshape(n, -1))
        x = self.norm(h, self.w[f"blk.{il}.ffn_norm.weight"])
        g = self.proj(f"blk.{il}.ffn_gate", x)
        u = self.proj(f"blk.{il}.ffn_up", x)
        return h + self.proj(f"blk.{il}.ffn_down", g / (1 + np.exp(-g)) * u)

    def head(self, h):
        return self.norm(h, self.w["output_norm.weight"]) @ self.w["output.weight"].T

    # -- whole passes ---------------------------------------------------------------------
    def new_cache(self):
        return [dict() for _ in range(self.n_layer)]

    def forward(self, tokens, pos, cache, exit_layer: int | None = None):
        """Run tokens at positions; with exit_layer l, run layers < l only and fill the K/V of
        layers >= l from the residual h_l (what the patch's exit does). Returns (logits of
        every token, list of residuals entering each layer that ran, plus h at the end)."""
        h = self.w["token_embd.weight"][np.asarray(tokens)]
        hs = [h]
        stop = self.n_layer if exit_layer is None else exit_layer
        for il in range(stop):
            h = self.layer(il, h, pos, cache)
            hs.append(h)
        for il in range(stop, self.n_layer):
            k, v = self.kv(il, h, pos)
            for i, p in enumerate(pos):
                cache[il][p] = (k[i], v[i])
        return self.head(h), hs

"""A stand-in paged decoder on the attnexport ops (until the zoo's Llama is on main): token
embedding, rotary positions, grouped-query attention over the paged cache, SiLU MLP, and the
logits of the rows in ``logits_indices``. Deterministic weights from a seed."""

from __future__ import annotations

import torch
from torch import nn

import attnexport  # noqa: F401  (registers the ops)
from attnexport.model_interface import CacheSpec


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class TinyDecoder(nn.Module):
    def __init__(
        self,
        vocab_size: int = 97,
        hidden: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        max_model_len: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.head_size = hidden // num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        g = torch.Generator().manual_seed(seed)

        def weight(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)

        self.embed = weight(vocab_size, hidden)
        kv = num_kv_heads * self.head_size
        self.qkv = nn.ParameterList([weight(hidden + 2 * kv, hidden) for _ in range(num_layers)])
        self.out = nn.ParameterList([weight(hidden, hidden) for _ in range(num_layers)])
        self.up = nn.ParameterList([weight(2 * hidden, hidden) for _ in range(num_layers)])
        self.down = nn.ParameterList([weight(hidden, 2 * hidden) for _ in range(num_layers)])
        self.lm_head = weight(vocab_size, hidden)

    def cache_spec(self, block_size: int = 4) -> CacheSpec:
        spec = (len(self.qkv), self.num_kv_heads, self.head_size, torch.float32, block_size)
        return CacheSpec(*spec)

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        h = self.embed[input_ids]
        d, heads, kv_heads = self.head_size, self.num_heads, self.num_kv_heads
        for i in range(len(self.qkv)):
            x = nn.functional.rms_norm(h, (h.shape[-1],))
            q, k, v = (x @ self.qkv[i].T).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q = _rotate(q.reshape(-1, heads, d), positions)
            k = _rotate(k.reshape(-1, kv_heads, d), positions)
            v = v.reshape(-1, kv_heads, d)
            key_cache, value_cache = kv_caches[2 * i], kv_caches[2 * i + 1]
            torch.ops.attnexport.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
            attn = torch.ops.attnexport.paged_attention(
                q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, d**-0.5
            )
            h = h + attn.reshape(-1, heads * d) @ self.out[i].T
            x = nn.functional.rms_norm(h, (h.shape[-1],))
            h = h + nn.functional.silu(x @ self.up[i].T) @ self.down[i].T
        h = nn.functional.rms_norm(h[logits_indices], (h.shape[-1],))
        return h @ self.lm_head.T

"""A paged "model" whose next token is an exact checksum of what its cache holds.

Each token writes (token id, position) into the paged cache with ``attnexport.reshape_and_cache``;
the next token of a sequence is computed from the pairs read back through its block table. Any
block that the engine mis-manages (a wrong table, a lost swap, a missing copy-on-write) changes
the checksum, so the engine's tokens equal :func:`reference_tokens` exactly iff every block
move was right. Integer-valued float64 keeps it exact.
"""

from __future__ import annotations

import torch
from torch import nn

import attnexport  # noqa: F401  (registers the ops)
from attnexport.model_interface import CacheSpec


def next_token(tokens: list[int], vocab_size: int) -> int:
    return (sum(t * (j + 1) for j, t in enumerate(tokens)) + 7 * len(tokens)) % vocab_size


def reference_tokens(prompt: list[int], max_tokens: int, vocab_size: int, max_len: int) -> list:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(next_token(tokens, vocab_size))
        if len(tokens) >= max_len:
            break
    return tokens[len(prompt) :]


class EchoDecoder(nn.Module):
    def __init__(self, vocab_size: int = 50, max_model_len: int = 64) -> None:
        super().__init__()
        self.vocab_size, self.max_model_len = vocab_size, max_model_len

    def cache_spec(self, block_size: int = 2) -> CacheSpec:
        return CacheSpec(1, 1, 2, torch.float64, block_size)

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        kv_caches,
    ):
        key_cache, value_cache = kv_caches
        entry = torch.stack([input_ids, positions], dim=-1).to(torch.float64)[:, None, :]
        torch.ops.attnexport.reshape_and_cache(entry, entry, key_cache, value_cache, slot_mapping)
        block_size = key_cache.shape[1]
        rows = torch.searchsorted(query_start_loc[1:], logits_indices.to(torch.int32), right=True)
        logits = torch.zeros(len(logits_indices), self.vocab_size)
        for row, seq in enumerate(rows.tolist()):
            length = int(seq_lens[seq])
            blocks = block_tables[seq, : -(-length // block_size)].long()
            held = key_cache[blocks].reshape(-1, 2)[:length]
            tokens, places = held[:, 0], held[:, 1]
            checksum = int((tokens * (places + 1)).sum()) + 7 * length
            logits[row, checksum % self.vocab_size] = 1.0
        return logits

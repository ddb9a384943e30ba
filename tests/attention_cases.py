"""Named, reproducible random attention batches for the test suites: :class:`AttentionCase`
and :func:`make_paged_inputs` / :func:`make_varlen_inputs` (ragged lengths, randomly permuted
blocks, padding slots) that every backend's suite runs; :func:`make_rotary_inputs` for
``rotary_embedding``; :func:`fill_unused_slots` fills the slots a batch does not own with
NaN/Inf (stale blocks)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnexport.custom_ops.alibi import alibi_slopes
from attnexport.custom_ops.kv_cache_dtype import is_scaled, quantize_rows


@dataclass(frozen=True)
class AttentionCase:
    """A batch: sequence i has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones."""

    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = True
    alibi: bool = False
    sliding_window: int = -1
    logits_soft_cap: float = 0.0
    slot_dtype: torch.dtype = torch.int64
    padded_tokens: int = 0
    """Extra padding tokens (slot -1) appended to the cache write."""
    spare_blocks: int = 3
    """Blocks in the cache beyond those the batch needs."""
    cache_dtype: torch.dtype | None = None
    """The KV caches' dtype; None: ``dtype``. int8 caches come with scale caches."""
    sinks: bool = False
    """paged_attention's attention sinks (a logit per head in each softmax)."""

    def with_(self, **changes) -> AttentionCase:
        return replace(self, **changes)

    @property
    def id(self) -> str:
        parts = [
            self.name,
            f"h{self.num_heads}/{self.num_kv_heads}",
            f"d{self.head_size}",
            f"bs{self.block_size}",
            str(self.dtype).removeprefix("torch."),
        ]
        if not self.causal:
            parts.append("noncausal")
        if self.alibi:
            parts.append("alibi")
        if self.sliding_window >= 0:
            parts.append(f"win{self.sliding_window}")
        if self.logits_soft_cap > 0:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.slot_dtype != torch.int64:
            parts.append("slot32")
        if self.padded_tokens:
            parts.append(f"pad{self.padded_tokens}")
        if self.cache_dtype is not None and self.cache_dtype != self.dtype:
            parts.append("cache-" + str(self.cache_dtype).removeprefix("torch."))
        if self.sinks:
            parts.append("sinks")
        return "-".join(parts)


BATCHES = {
    "prefill": ((7, 16, 1, 33), (0, 0, 0, 0)),
    "decode": ((1, 1, 1, 1, 1), (5, 16, 31, 64, 100)),
    "chunked": ((8, 20), (24, 7)),
    "mixed": ((1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
    "single": ((1,), (0,)),
    "empty_seq": ((0, 3, 1), (4, 0, 9)),
}


def _random(shape, dtype, generator, device) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)


def make_paged_inputs(case: AttentionCase, device="cpu", seed: int = 0) -> dict:
    """Random inputs for ``reshape_and_cache`` + ``paged_attention`` of ``case``.

    The caches hold random context (and garbage in unused slots); block tables use randomly
    permuted blocks padded with 0. Returns a dict with ``query``, ``key``, ``value`` (the new
    tokens, with ``case.padded_tokens`` padding rows at the end), ``key_cache``,
    ``value_cache`` (context already written, in ``case.cache_dtype``), ``key_scale_cache``,
    ``value_scale_cache`` (int8 caches; else None), ``slot_mapping``, ``block_tables``,
    ``seq_lens``, ``query_start_loc`` and the attention keyword arguments ``kwargs`` (with the
    scale caches when there are).
    """
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_size
    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens, strict=True)]
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + case.spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, start = [], [], 0
    width = max([*blocks_per_seq, 1]) + 1  # one spare column, left as padding
    for n, ctx, q in zip(blocks_per_seq, case.context_lens, case.query_lens, strict=True):
        blocks = perm[start : start + n]
        start += n
        tables.append(blocks + [0] * (width - n))
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
    total_new = sum(case.query_lens)
    key_cache = _random((num_blocks, bs, kvh, d), case.dtype, g, device)
    value_cache = _random((num_blocks, bs, kvh, d), case.dtype, g, device)
    scales = {"key_scale_cache": None, "value_scale_cache": None}
    cache_dtype = case.cache_dtype or case.dtype
    if is_scaled(cache_dtype):
        key_cache, scales["key_scale_cache"] = quantize_rows(key_cache)
        value_cache, scales["value_scale_cache"] = quantize_rows(value_cache)
    else:
        key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    pad = case.padded_tokens
    kwargs = attention_kwargs(case, device)
    if scales["key_scale_cache"] is not None:
        kwargs.update(scales)
    if case.sinks:  # about the logits' size: some rows' sink outweighs their keys
        kwargs["sinks"] = torch.linspace(-1.0, 3.0, case.num_heads, device=device)
    return {
        **scales,
        "query": _random((total_new, case.num_heads, d), case.dtype, g, device),
        "key": _random((total_new + pad, kvh, d), case.dtype, g, device),
        "value": _random((total_new + pad, kvh, d), case.dtype, g, device),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": torch.tensor(slots + [-1] * pad, dtype=case.slot_dtype, device=device),
        "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(
            [0, *torch.tensor(case.query_lens).cumsum(0).tolist()],
            dtype=torch.int32,
            device=device,
        ),
        "kwargs": kwargs,
    }


def cache_write_args(x: dict) -> tuple:
    """The arguments of ``reshape_and_cache`` from a :func:`make_paged_inputs` dict (with the
    scale caches when the caches are int8)."""
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    scales = (x["key_scale_cache"], x["value_scale_cache"])
    return (*(x[n] for n in names), *(scales if scales[0] is not None else ()))


def fill_unused_slots(x: dict, fill: float) -> dict:
    """Writes the new tokens of a :func:`make_paged_inputs` dict ``x`` into its caches and sets
    every slot that no sequence's first ``seq_lens[i]`` keys occupy to ``fill`` (NaN or +-inf:
    what a freed block may hold). Returns ``x``, its caches changed in place."""
    key_cache, value_cache = x["key_cache"], x["value_cache"]
    slots = x["slot_mapping"].to(torch.int64)
    keep = slots >= 0
    block_size = key_cache.shape[1]
    for cache, new in ((key_cache, x["key"]), (value_cache, x["value"])):
        cache.view(-1, *cache.shape[2:])[slots[keep]] = new[keep]
    used = torch.zeros(key_cache.shape[0] * block_size, dtype=torch.bool)
    for row, seq_len in zip(x["block_tables"].tolist(), x["seq_lens"].tolist(), strict=True):
        for position in range(seq_len):
            used[row[position // block_size] * block_size + position % block_size] = True
    for cache in (key_cache, value_cache):
        cache.view(-1, *cache.shape[2:])[~used.to(cache.device)] = fill
    return x


def make_varlen_inputs(case: AttentionCase, device="cpu", seed: int = 0) -> dict:
    """Random inputs for ``varlen_attention``: sequence i has ``query_lens[i]`` queries and
    ``context_lens[i] + query_lens[i]`` keys. Returns ``query``, ``key``, ``value``,
    ``cu_seqlens_q``, ``cu_seqlens_k`` and ``kwargs``."""
    g = torch.Generator().manual_seed(seed)
    key_lens = [c + q for c, q in zip(case.context_lens, case.query_lens, strict=True)]

    def offsets(lens):
        return torch.tensor(
            [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        )

    return {
        "query": _random(
            (sum(case.query_lens), case.num_heads, case.head_size), case.dtype, g, device
        ),
        "key": _random((sum(key_lens), case.num_kv_heads, case.head_size), case.dtype, g, device),
        "value": _random((sum(key_lens), case.num_kv_heads, case.head_size), case.dtype, g, device),
        "cu_seqlens_q": offsets(case.query_lens),
        "cu_seqlens_k": offsets(key_lens),
        "kwargs": attention_kwargs(case, device),
    }


def attention_kwargs(case: AttentionCase, device="cpu") -> dict:
    """The scalar and ALiBi arguments of ``case`` for paged/varlen attention."""
    return {
        "scale": case.head_size**-0.5,
        "causal": case.causal,
        "alibi_slopes": alibi_slopes(case.num_heads).to(device) if case.alibi else None,
        "sliding_window": case.sliding_window,
        "logits_soft_cap": case.logits_soft_cap,
    }


def make_rotary_inputs(
    tokens: int, heads: int, head_size: int, dtype=torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``x`` ``[T, H, D]`` and the cos/sin tables ``[T, D]`` of random positions < 4096
    (RoPE with theta 10000, as models build them), for ``rotary_embedding``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_size, generator=generator).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    inv_freq = 10000.0 ** -(torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = positions[:, None].double() * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def standard_cases() -> list[AttentionCase]:
    """The parametrized matrix every backend suite runs (each backend skips, with its reasons,
    the cases it does not support)."""
    cases = []
    for batch, (query_lens, context_lens) in BATCHES.items():
        base = AttentionCase(batch, query_lens, context_lens)
        cases.append(base)
        cases.append(base.with_(alibi=True))
        cases.append(base.with_(sliding_window=5))
        cases.append(base.with_(logits_soft_cap=2.0))
    decode = AttentionCase("decode", *BATCHES["decode"])
    mixed = AttentionCase("mixed", *BATCHES["mixed"])
    for heads, kv_heads in ((4, 4), (8, 2), (16, 2)):  # GQA 1x, 4x, 8x
        cases.append(mixed.with_(num_heads=heads, num_kv_heads=kv_heads))
    for head_size in (64, 80, 128, 256):
        cases.append(decode.with_(head_size=head_size))
    for block_size in (8, 32, 64):
        cases.append(mixed.with_(block_size=block_size))
    for dtype in (torch.bfloat16, torch.float16):
        cases.append(mixed.with_(dtype=dtype))
        cases.append(decode.with_(dtype=dtype, num_heads=32, num_kv_heads=8, head_size=128))
        cases.append(mixed.with_(dtype=dtype, alibi=True, sliding_window=9, logits_soft_cap=5.0))
    cases.append(mixed.with_(alibi=True, sliding_window=6, logits_soft_cap=3.0))
    cases.append(mixed.with_(slot_dtype=torch.int32, padded_tokens=3))
    for batch in ("prefill", "decode", "chunked", "mixed", "empty_seq"):  # attention sinks
        cases.append(AttentionCase(batch, *BATCHES[batch], sinks=True))
    cases.append(mixed.with_(sinks=True, num_heads=8, sliding_window=6, logits_soft_cap=3.0))
    cases.append(mixed.with_(sinks=True, dtype=torch.bfloat16))
    # a context long enough that the native kernel splits its decode (>= 32 blocks of 16)
    cases.append(AttentionCase("split_decode", (1, 1), (700, 40), sinks=True))
    cases.append(AttentionCase("cross", (3, 1, 6), (5, 9, 0), causal=False))
    cases.append(
        AttentionCase("cross", (3, 1, 6), (5, 9, 0), causal=False, alibi=True, sliding_window=4)
    )
    return cases


KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def cache_dtype_cases() -> list[AttentionCase]:
    """Every cache dtype under float32 activations (and half-precision activations over an
    int8 or float32 cache) over the batch shapes, with the logits options, GQA and padding."""
    cases = []
    for cache_dtype in KV_CACHE_DTYPES:
        for batch in ("prefill", "decode", "chunked", "mixed", "empty_seq"):
            cases.append(AttentionCase(batch, *BATCHES[batch], cache_dtype=cache_dtype))
        mixed = AttentionCase("mixed", *BATCHES["mixed"], cache_dtype=cache_dtype)
        cases.append(mixed.with_(alibi=True, sliding_window=6, logits_soft_cap=3.0))
        cases.append(mixed.with_(num_heads=8, num_kv_heads=2, slot_dtype=torch.int32))
        cases.append(mixed.with_(padded_tokens=3, block_size=8))
        cases.append(
            AttentionCase("cross", (3, 1, 6), (5, 9, 0), causal=False, cache_dtype=cache_dtype)
        )
    for dtype in (torch.float16, torch.bfloat16):
        for cache_dtype in (torch.int8, torch.float32):
            cases.append(
                AttentionCase("mixed", *BATCHES["mixed"], dtype=dtype, cache_dtype=cache_dtype)
            )
    return cases

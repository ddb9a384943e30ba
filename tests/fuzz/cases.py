"""Hypothesis strategies for the fuzz suite: for each op a well-formed call, and for each class
of malformed input a mutation of one (:data:`KINDS`).

Each strategy returns a :class:`~tests.fuzz.worker.FuzzCase` whose ``valid`` says what the
oracle expects: True (the float64 reference's answer), False (a named error before any write) or
None (either: an ONNX session converts index inputs of another integer dtype, as documented, so
int64 ids that fit in int32 may run there while the eager ops refuse them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_rotary_inputs,
    make_varlen_inputs,
)
from tests.fuzz.worker import FuzzCase

INT32_MAX = 2**31 - 1
WRAP = 2**32  # added to an int64 id, it survives a truncation to int32 unchanged

_HEADS = [(2, 1), (4, 2), (2, 2), (4, 1)]
_SMALL_DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float16]
_ATTENTION_INPUTS = {
    "paged_attention": (
        "query",
        "key_cache",
        "value_cache",
        "block_tables",
        "seq_lens",
        "query_start_loc",
    ),
    "varlen_attention": ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k"),
    "reshape_and_cache": ("key", "value", "key_cache", "value_cache", "slot_mapping"),
}


@st.composite
def _attention_case(
    draw, min_seqs: int = 1, max_seqs: int = 3, heads=None, causal=None, **fixed
) -> AttentionCase:
    num_seqs = draw(st.integers(min_seqs, max_seqs))
    query_lens = draw(st.lists(st.integers(0, 4), min_size=num_seqs, max_size=num_seqs))
    query_lens[0] = max(query_lens[0], 1)
    context_lens = draw(st.lists(st.integers(0, 12), min_size=num_seqs, max_size=num_seqs))
    num_heads, num_kv_heads = heads or draw(st.sampled_from(_HEADS))
    fields = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": draw(st.sampled_from([8, 16])),
        "block_size": draw(st.sampled_from([4, 8])),
        "causal": draw(st.booleans()) if causal is None else causal,
        "alibi": draw(st.booleans()),
        "sliding_window": draw(st.sampled_from([-1, -1, 3])),
        "logits_soft_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "slot_dtype": draw(st.sampled_from([torch.int32, torch.int64])),
        "padded_tokens": draw(st.integers(0, 2)),
        "dtype": draw(st.sampled_from(_SMALL_DTYPES)),
    }
    return AttentionCase("fuzz", tuple(query_lens), tuple(context_lens), **(fields | fixed))


def _split(op: str, x: dict) -> tuple[dict, dict]:
    inputs = {name: x[name] for name in _ATTENTION_INPUTS[op]}
    return inputs, dict(x.get("kwargs", {}))


def _case(op, kind, inputs, attrs, template, valid, rewrite=None) -> FuzzCase:
    if kind == "inference_mode":  # a well-formed call, under torch.inference_mode()
        return FuzzCase(op, kind, inputs, attrs, template, True, inference_mode=True)
    return FuzzCase(op, kind, inputs, attrs, template, valid, rewrite=rewrite or {})


def _generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**16)))


def _clone(inputs: dict) -> dict:
    return {name: t.clone() for name, t in inputs.items()}


def _reranked(draw, inputs: dict) -> dict:
    """One input with a dimension too many or too few."""
    name = draw(st.sampled_from(sorted(inputs)))
    tensor = inputs[name]
    if tensor.dim() == 0 or draw(st.booleans()):
        tensor = tensor.unsqueeze(draw(st.integers(0, tensor.dim())))
    elif tensor.shape[0] > 0:
        tensor = tensor[0]
    else:
        tensor = tensor.reshape(-1)[None, None]
    return inputs | {name: tensor.contiguous()}


# --------------------------------------------------------------------------- paged_attention


def _visible_slots(x: dict, block_size: int) -> set[int]:
    slots = set()
    for row, seq_len in zip(x["block_tables"].tolist(), x["seq_lens"].tolist(), strict=True):
        slots.update(row[p // block_size] * block_size + p % block_size for p in range(seq_len))
    return slots


@st.composite
def paged_attention(draw, kind: str) -> FuzzCase:
    constraints = {
        "heads": {"heads": (4, 2)},
        "seq_short": {"causal": True},
        "qsl_nonmono": {"min_seqs": 2},
        "qsl_wrap": {"min_seqs": 4, "max_seqs": 4, "causal": False},
        "empty_table": {"causal": False},
    }.get(kind, {})
    case = draw(_attention_case(**constraints))
    inputs, attrs = _split(
        "paged_attention", make_paged_inputs(case, seed=draw(st.integers(0, 99)))
    )
    template = _clone(inputs)
    x = _clone(inputs)
    bs, num_blocks = case.block_size, x["key_cache"].shape[0]
    tokens = x["query"].shape[0]
    valid, rewrite = False, {}
    if kind in ("well_formed", "inference_mode"):
        valid = True
    elif kind == "memo_rewrite_valid":
        # Another well-formed batch of the same shapes, written where the first one was.
        width = x["block_tables"].shape[1]
        g = _generator(draw)
        queries = x["query_start_loc"].diff()
        low = queries if case.causal else torch.zeros_like(queries)
        span = width * bs - low + 1
        seq_lens = low + (torch.rand(low.shape, generator=g) * span).long().clamp(max=span - 1)
        rewrite = {
            "block_tables": torch.randint(
                0, num_blocks, x["block_tables"].shape, generator=g
            ).int(),
            "seq_lens": seq_lens.int(),
        }
        valid = True
    elif kind == "memo_rewrite_bad":
        if draw(st.booleans()):
            tables = x["block_tables"].clone()
            tables[0, 0] = num_blocks + draw(st.integers(0, 3))
            rewrite = {"block_tables": tables}
        else:
            seq_lens = x["seq_lens"].clone()
            seq_lens[0] = x["block_tables"].shape[1] * bs + draw(st.integers(1, 9))
            rewrite = {"seq_lens": seq_lens}
    elif kind == "stale_nan":
        # Pools left full of NaN/Inf by earlier requests: every slot no sequence can see.
        poison = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        visible = _visible_slots(x, bs)
        for cache in (x["key_cache"], x["value_cache"]):
            flat = cache.view(-1, *cache.shape[2:])
            hidden = [s for s in range(flat.shape[0]) if s not in visible]
            flat[hidden] = poison
        valid = True
    elif kind == "float64_query":
        x["query"] = x["query"].double()
    elif kind == "int64_ids":
        name = draw(st.sampled_from(["block_tables", "seq_lens", "query_start_loc"]))
        x[name] = x[name].long()
        valid = None
    elif kind == "int64_ids_wrap":
        name = draw(st.sampled_from(["block_tables", "seq_lens", "query_start_loc"]))
        x[name] = x[name].long()
        index = (0, 0) if name == "block_tables" else (1 if name == "query_start_loc" else 0)
        x[name][index] += WRAP
    elif kind == "rank":
        x = _reranked(draw, x)
    elif kind == "shape":
        change = draw(st.sampled_from(["value_cache", "head_size", "rows", "offsets", "lens"]))
        if change == "value_cache":
            x["value_cache"] = x["value_cache"][: num_blocks - 1].contiguous()
        elif change == "head_size":
            x["query"] = torch.randn(tokens, case.num_heads, case.head_size + 2).to(case.dtype)
        elif change == "rows":
            x["block_tables"] = torch.cat((x["block_tables"], x["block_tables"][:1]))
        elif change == "offsets":
            x["query_start_loc"] = torch.cat((x["query_start_loc"], x["query_start_loc"][-1:]))
        else:
            x["seq_lens"] = torch.cat((x["seq_lens"], x["seq_lens"][:1]))
    elif kind == "heads":
        x["query"] = torch.randn(tokens, case.num_heads + 1, case.head_size).to(case.dtype)
        attrs["alibi_slopes"] = None
    elif kind == "block_id":
        i = 0  # sequence 0 has a query token, so a key
        used = -(-int(x["seq_lens"][0]) // bs)
        j = draw(st.integers(0, used - 1))
        x["block_tables"][i, j] = draw(
            st.sampled_from([-1, -num_blocks, -(2**31), num_blocks, num_blocks + 5, INT32_MAX])
        )
    elif kind == "seq_short":
        queries = int(x["query_start_loc"][1])
        x["seq_lens"][0] = draw(st.integers(0, queries - 1))
    elif kind == "seq_past_table":
        i = draw(st.integers(0, x["seq_lens"].shape[0] - 1))
        x["seq_lens"][i] = x["block_tables"].shape[1] * bs + draw(st.integers(1, 64))
    elif kind == "seq_huge":
        i = draw(st.integers(0, x["seq_lens"].shape[0] - 1))
        x["seq_lens"][i] = INT32_MAX - draw(st.integers(0, 3))
    elif kind == "qsl_nonmono":
        x["query_start_loc"][1] = x["query_start_loc"][2] + draw(st.integers(1, 3))
    elif kind == "qsl_last":
        x["query_start_loc"][-1] = tokens + draw(st.sampled_from([-1, 1, 2, 7]))
    elif kind == "qsl_wrap":
        # Differences taken in int32 are all >= 0: the offsets pass a monotone check that
        # does not widen them, while the lengths they imply are ~2^31 tokens.
        x["query_start_loc"] = torch.tensor(
            [0, INT32_MAX, -INT32_MAX, 0, tokens], dtype=torch.int32
        )
    elif kind == "empty_table":
        num_seqs = x["seq_lens"].shape[0]
        x["block_tables"] = torch.zeros(num_seqs, 0, dtype=torch.int32)
        x["seq_lens"] = torch.tensor(
            draw(st.lists(st.sampled_from([0, 0, 1]), min_size=num_seqs, max_size=num_seqs)),
            dtype=torch.int32,
        )
        valid = int(x["seq_lens"].max()) == 0
    else:
        raise AssertionError(kind)
    return _case("paged_attention", kind, x, attrs, template, valid, rewrite)


# --------------------------------------------------------------------------- varlen_attention


@st.composite
def varlen_attention(draw, kind: str) -> FuzzCase:
    constraints = {
        "heads": {"heads": (4, 2)},
        "offsets_nonmono": {"min_seqs": 2},
        "offsets_wrap": {"min_seqs": 4, "max_seqs": 4},
    }.get(kind, {})
    case = draw(_attention_case(**constraints))
    inputs, attrs = _split(
        "varlen_attention", make_varlen_inputs(case, seed=draw(st.integers(0, 99)))
    )
    template, x = _clone(inputs), _clone(inputs)
    tokens = x["query"].shape[0]
    which = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    total = x["query" if which == "cu_seqlens_q" else "key"].shape[0]
    valid, rewrite = False, {}
    if kind in ("well_formed", "inference_mode"):
        valid = True
    elif kind == "memo_rewrite_valid":
        # The same tokens split differently between the sequences.
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=x[which].shape[0] - 2)))
        cuts = cuts[: x[which].shape[0] - 2]
        rewrite = {which: torch.tensor([0, *cuts, total], dtype=torch.int32)}
        valid = True
    elif kind == "memo_rewrite_bad":
        offsets = x[which].clone()
        offsets[-1] = total + draw(st.integers(1, 9))
        rewrite = {which: offsets}
    elif kind == "float64_query":
        x["query"] = x["query"].double()
    elif kind == "int64_ids":
        x[which] = x[which].long()
        valid = None
    elif kind == "int64_ids_wrap":
        x[which] = x[which].long()
        x[which][1] += WRAP
    elif kind == "rank":
        x = _reranked(draw, x)
    elif kind == "shape":
        change = draw(st.sampled_from(["value", "head_size", "offsets"]))
        if change == "value":
            x["value"] = torch.cat((x["value"], x["value"][:1]))
        elif change == "head_size":
            x["query"] = torch.randn(tokens, case.num_heads, case.head_size + 2).to(case.dtype)
        else:
            x["cu_seqlens_k"] = torch.cat((x["cu_seqlens_k"], x["cu_seqlens_k"][-1:]))
    elif kind == "heads":
        x["query"] = torch.randn(tokens, case.num_heads + 1, case.head_size).to(case.dtype)
        attrs["alibi_slopes"] = None
    elif kind == "offsets_nonmono":
        x[which][1] = x[which][2] + draw(st.integers(1, 3))
    elif kind == "offsets_last":
        x[which][-1] = total + draw(st.sampled_from([-1, 1, 2, 7]))
    elif kind == "offsets_wrap":
        x[which] = torch.tensor([0, INT32_MAX, -INT32_MAX, 0, total], dtype=torch.int32)
    else:
        raise AssertionError(kind)
    return _case("varlen_attention", kind, x, attrs, template, valid, rewrite)


# --------------------------------------------------------------------------- reshape_and_cache


@st.composite
def reshape_and_cache(draw, kind: str) -> FuzzCase:
    case = draw(_attention_case())
    inputs, _ = _split("reshape_and_cache", make_paged_inputs(case, seed=draw(st.integers(0, 99))))
    template, x = _clone(inputs), _clone(inputs)
    num_blocks, bs = x["key_cache"].shape[:2]
    capacity = num_blocks * bs
    written = (x["slot_mapping"] >= 0).nonzero().flatten().tolist()
    valid, rewrite = False, {}
    if kind in ("well_formed", "inference_mode"):
        valid = True
    elif kind == "memo_rewrite_valid":
        slots = torch.randperm(capacity, generator=_generator(draw))[: len(written)]
        new = x["slot_mapping"].clone()
        new[written] = slots.to(new.dtype)
        rewrite, valid = {"slot_mapping": new}, True
    elif kind == "memo_rewrite_bad":
        new = x["slot_mapping"].clone()
        new[written[0]] = capacity + draw(st.integers(0, 9))
        rewrite = {"slot_mapping": new}
    elif kind == "float64_key":
        x["key"] = x["key"].double()
    elif kind == "float_slots":
        x["slot_mapping"] = x["slot_mapping"].float()
    elif kind == "int64_slots_wrap":
        x["slot_mapping"] = x["slot_mapping"].long()
        x["slot_mapping"][written[0]] += WRAP
    elif kind == "rank":
        x = _reranked(draw, x)
    elif kind == "shape":
        change = draw(st.sampled_from(["value", "heads", "value_cache", "slots"]))
        if change == "value":
            x["value"] = torch.cat((x["value"], x["value"][:1]))
        elif change == "heads":
            x["key"] = torch.randn(x["key"].shape[0], case.num_kv_heads + 1, case.head_size).to(
                case.dtype
            )
        elif change == "value_cache":
            x["value_cache"] = x["value_cache"][:, : bs - 1].contiguous()
        else:
            x["slot_mapping"] = torch.cat((x["slot_mapping"], x["slot_mapping"][:1]))
    elif kind == "slot_past":
        t = draw(st.sampled_from(written))
        x["slot_mapping"][t] = capacity + draw(st.sampled_from([0, 1, bs, 1000]))
    elif kind == "slot_dup":
        if len(written) < 2:
            x["key"], x["value"] = (
                torch.cat((x["key"], x["key"][:1])),
                torch.cat((x["value"], x["value"][:1])),
            )
            x["slot_mapping"] = torch.cat((x["slot_mapping"], x["slot_mapping"][written[0] :][:1]))
        else:
            x["slot_mapping"][written[1]] = x["slot_mapping"][written[0]]
    else:
        raise AssertionError(kind)
    return _case("reshape_and_cache", kind, x, {}, template, valid, rewrite)


# --------------------------------------------------------------------------- elementwise ops


def _wrong_dtype(draw, x: dict) -> dict:
    """One input in a dtype the op refuses: an integer one, or float64 beside other inputs
    (alone, as silu_and_mul's only input, float64 is a valid floating dtype)."""
    name = draw(st.sampled_from(sorted(x)))
    floats = [torch.float64] if len(x) > 1 else []
    dtype = draw(st.sampled_from([*floats, torch.int32, torch.int64]))
    return x | {name: x[name].to(dtype)}


def _elementwise_case(
    draw, op: str, kind: str, template: dict, attrs: dict, reshaped: Callable[[dict], dict]
) -> FuzzCase:
    """The kinds every elementwise op shares: well formed (also under inference mode), one
    input in a dtype the op refuses, one of another rank, and ``reshaped(inputs)``: shapes that
    disagree, as the op draws them."""
    inputs, valid = dict(template), kind in ("well_formed", "inference_mode")
    if kind == "dtype":
        inputs = _wrong_dtype(draw, inputs)
    elif kind == "rank":
        inputs = _reranked(draw, inputs)
    elif kind == "shape":
        inputs = reshaped(inputs)
    elif not valid:
        raise AssertionError(kind)
    return _case(op, kind, inputs, attrs, template, valid)


@st.composite
def rotary_embedding(draw, kind: str) -> FuzzCase:
    tokens, heads = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    head_size = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from(_SMALL_DTYPES))
    x, cos, sin = make_rotary_inputs(tokens, heads, head_size, dtype, draw(st.integers(0, 99)))

    def reshaped(inputs: dict) -> dict:
        change = draw(st.sampled_from(["odd", "tokens", "width"]))
        if change == "odd":
            return {n: t[..., :-1].contiguous() for n, t in inputs.items()}
        if change == "tokens":
            extra = cos[:1] if tokens else torch.ones(1, head_size, dtype=dtype)
            return inputs | {"cos": torch.cat((cos, extra))}
        return inputs | {"sin": sin[:, : head_size // 2].contiguous()}

    template = {"x": x, "cos": cos, "sin": sin}
    return _elementwise_case(draw, "rotary_embedding", kind, template, {}, reshaped)


@st.composite
def qkv_rotary_embedding(draw, kind: str) -> FuzzCase:
    tokens = draw(st.integers(0, 5))
    heads, kv_heads = draw(st.sampled_from(_HEADS))
    head_size = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from(_SMALL_DTYPES))
    _, cos, sin = make_rotary_inputs(tokens, 1, head_size, dtype, draw(st.integers(0, 99)))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    template = {"qkv": qkv, "cos": cos, "sin": sin}
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads}
    if kind == "head_counts":
        attrs[draw(st.sampled_from(sorted(attrs)))] = draw(st.sampled_from([0, -1, -2]))
        return _case("qkv_rotary_embedding", kind, dict(template), attrs, template, False)

    def reshaped(inputs: dict) -> dict:
        change = draw(st.sampled_from(["width", "tokens", "odd"]))
        if change == "width":
            return inputs | {"qkv": torch.cat((qkv, qkv[:, :head_size]), dim=1)}
        if change == "tokens":
            return inputs | {"sin": torch.cat((sin, torch.ones(1, head_size, dtype=dtype)))}
        return {n: t[:, :-1].contiguous() for n, t in inputs.items()}

    return _elementwise_case(draw, "qkv_rotary_embedding", kind, template, attrs, reshaped)


@st.composite
def silu_and_mul(draw, kind: str) -> FuzzCase:
    tokens, half = draw(st.integers(0, 5)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(_SMALL_DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    x = (torch.randn(tokens, 2 * half, generator=g) * 4).to(dtype)
    if kind == "rank":  # leading dims are allowed ([..., T, 2 * d]): too few is the bad rank
        return _case("silu_and_mul", kind, {"x": x.reshape(-1)}, {}, {"x": x}, False)
    return _elementwise_case(
        draw, "silu_and_mul", kind, {"x": x}, {}, lambda _: {"x": x[:, :-1].contiguous()}
    )


@st.composite
def fused_add_rms_norm(draw, kind: str) -> FuzzCase:
    tokens, hidden = draw(st.integers(0, 5)), draw(st.integers(1, 48))
    dtype = draw(st.sampled_from(_SMALL_DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    template = {
        "x": torch.randn(tokens, hidden, generator=g).to(dtype),
        "residual": torch.randn(tokens, hidden, generator=g).to(dtype),
        "weight": torch.randn(hidden, generator=g).to(dtype),
    }

    def reshaped(inputs: dict) -> dict:
        name = draw(st.sampled_from(["residual", "weight"]))
        return inputs | {name: torch.cat((inputs[name], inputs[name][..., :1]), dim=-1)}

    attrs = {"epsilon": 1e-5}
    return _elementwise_case(draw, "fused_add_rms_norm", kind, template, attrs, reshaped)


# Issue 16 item 4: the ops under torch.inference_mode(), and metadata rewritten in place
# behind the validation memo (a valid rewrite must be used, an invalid one refused).
_MEMO = ["inference_mode", "memo_rewrite_valid", "memo_rewrite_bad"]
_COMMON = ["well_formed", "inference_mode", "dtype", "rank", "shape"]
# the malformed queries and offsets both attention ops refuse
_ATTENTION = ["float64_query", "int64_ids", "int64_ids_wrap", "rank", "shape", "heads"]
KINDS: dict[str, tuple[Callable, list[str]]] = {
    "reshape_and_cache": (
        reshape_and_cache,
        [
            "well_formed",
            *_MEMO,
            "float64_key",
            "float_slots",
            "int64_slots_wrap",
            "rank",
            "shape",
            "slot_past",
            "slot_dup",
        ],
    ),
    "paged_attention": (
        paged_attention,
        [
            "well_formed",
            *_MEMO,
            "stale_nan",
            *_ATTENTION,
            "block_id",
            "seq_short",
            "seq_past_table",
            "seq_huge",
            "qsl_nonmono",
            "qsl_last",
            "qsl_wrap",
            "empty_table",
        ],
    ),
    "varlen_attention": (
        varlen_attention,
        [
            "well_formed",
            *_MEMO,
            *_ATTENTION,
            "offsets_nonmono",
            "offsets_last",
            "offsets_wrap",
        ],
    ),
    "rotary_embedding": (rotary_embedding, _COMMON),
    "qkv_rotary_embedding": (qkv_rotary_embedding, [*_COMMON, "head_counts"]),
    "silu_and_mul": (silu_and_mul, _COMMON),
    "fused_add_rms_norm": (fused_add_rms_norm, _COMMON),
}
# Head counts are attributes of an ONNX node, fixed when the graph is built: not an input.
# Rewrites behind a memo and inference mode concern the eager ops only.
EAGER_ONLY = {("qkv_rotary_embedding", "head_counts")} | {
    (op, kind) for op, (_, kinds) in KINDS.items() for kind in kinds if kind in _MEMO
}

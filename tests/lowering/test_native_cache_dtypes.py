"""The native kernels with a KV cache dtype of its own (issue 19): float32/float16/bfloat16
queries over float32, float16, bfloat16 or int8 caches (int8 with float32 scale caches), and
ReshapeAndCache converting or quantizing the rows it writes.

Single nodes built by hand (:func:`attnexport.ort_kernels.node_model.node_model`, no function
bodies) run in onnxruntime with the kernel library, against a NumPy implementation of the
cache dtype contract: quantized caches and scales bit-exact, attention at the output dtype's
tolerance against a float64 computation over the dequantized caches."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
import torch

from attnexport import ort_kernels
from attnexport.lowering.ort_session import PagedOrtSession
from attnexport.ort_kernels.node_model import node_model
from attnexport.tolerances import tolerance
from tests.attention_cases import AttentionCase, make_paged_inputs
from tests.helpers import bf16_pairs_run, requires_ort_kernels

pytestmark = requires_ort_kernels


# ------------------------------------------------------------------ the contract, in NumPy


def quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows and float32 scales of float32 ``rows`` [..., D] (the op contract):
    ``scale = amax / 127``, ``q = clamp(rint(x / scale), -127, 127)`` or 0 where scale is 0."""
    rows = rows.astype(np.float32)
    scale = (np.abs(rows).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(rows / scale[..., None]), -127, 127)
    q = np.where(scale[..., None] > 0, q, 0).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * scale[..., None]).astype(np.float32)


def attention(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    scale: float,
    causal: bool,
    sliding_window: int,
    logits_soft_cap: float,
    alibi_slopes: np.ndarray | None,
) -> np.ndarray:
    """Paged attention in float64 over float caches (docs/ops.md): query [T, H, D], caches
    [num_blocks, block_size, Hkv, D] -> [T, H, D]."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (query, key_cache, value_cache))
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = np.zeros_like(q64)
    for s, length in enumerate(seq_lens.tolist()):
        begin, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        positions = np.arange(length)
        blocks = block_tables[s][positions // block_size]
        keys = k64[blocks, positions % block_size]  # [length, Hkv, D]
        values = v64[blocks, positions % block_size]
        for j, t in enumerate(range(begin, end)):
            p = length - (end - begin) + j
            visible = np.ones(length, dtype=bool)
            if causal:
                visible &= positions <= p
            if sliding_window >= 0:
                visible &= positions > p - sliding_window
            if not visible.any():
                continue
            for h in range(query.shape[1]):
                scores = scale * keys[visible, h // group] @ q64[t, h]
                if logits_soft_cap > 0:
                    scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
                if alibi_slopes is not None:
                    scores = scores + alibi_slopes[h] * (positions[visible] - p)
                weights = np.exp(scores - scores.max())
                out[t, h] = weights @ values[visible, h // group] / weights.sum()
    return out


# ------------------------------------------------------------------ sessions


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    ort_kernels.register(options)
    return options


def _attention_session(inputs: dict, case: AttentionCase, prefill_bf16: int = 0) -> PagedOrtSession:
    kwargs = make_paged_inputs(case)["kwargs"]
    model = node_model(
        "PagedAttention",
        inputs,
        {"output": inputs["query"]},
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        block_size=case.block_size,
        scale=kwargs["scale"],
        causal=int(case.causal),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
        **({"prefill_bf16": prefill_bf16} if prefill_bf16 else {}),
    )
    return PagedOrtSession(model, session_options=_options())


def _write_session(inputs: dict, block_size: int) -> PagedOrtSession:
    outputs = {f"{n}_out": inputs[n] for n in ("key_cache", "value_cache")}
    for name in ("key_scale_cache", "value_scale_cache"):
        if inputs.get(name) is not None:
            outputs[f"{name}_out"] = inputs[name]
    model = node_model("ReshapeAndCache", inputs, outputs, block_size=block_size)
    return PagedOrtSession(model, session_options=_options())


def _write_inputs(x: dict, cache_dtype: torch.dtype, key_dtype: torch.dtype) -> dict:
    """ReshapeAndCache inputs: x's new rows in ``key_dtype``, caches of ``cache_dtype`` (int8:
    random rows and scales, so that the untouched slots are checked too)."""
    inputs = {
        "key": x["key"].to(key_dtype),
        "value": x["value"].to(key_dtype),
        "key_cache": x["key_cache"].to(cache_dtype),
        "value_cache": x["value_cache"].to(cache_dtype),
        "slot_mapping": x["slot_mapping"],
    }
    if cache_dtype == torch.int8:
        g = torch.Generator().manual_seed(1)
        for name in ("key_cache", "value_cache"):
            shape = inputs[name].shape
            inputs[name] = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
            inputs[name.replace("cache", "scale_cache")] = torch.rand(shape[:3], generator=g)
    return inputs


def _expected_caches(inputs: dict) -> dict[str, np.ndarray]:
    """What ReshapeAndCache leaves in each cache of ``inputs`` (before it runs), as bits."""
    slots = inputs["slot_mapping"].to(torch.int64)
    keep = slots >= 0
    expected = {}
    for part in ("key", "value"):
        cache = inputs[f"{part}_cache"]
        rows = inputs[part][keep]
        if cache.dtype == torch.int8:
            q, scale = quantize(rows.to(torch.float32).numpy())
            flat = cache.numpy().copy().reshape(-1, *cache.shape[2:])
            flat[slots[keep].numpy()] = q
            expected[f"{part}_cache"] = flat.reshape(cache.shape)
            scales = inputs[f"{part}_scale_cache"].numpy().copy().reshape(-1, cache.shape[2])
            scales[slots[keep].numpy()] = scale
            expected[f"{part}_scale_cache"] = scales.reshape(cache.shape[:3])
        else:
            written = cache.clone()
            written.view(-1, *cache.shape[2:])[slots[keep]] = rows.to(cache.dtype)  # RNE
            expected[f"{part}_cache"] = _bits(written)
    return expected


def _run(session: PagedOrtSession, inputs: dict) -> dict[str, torch.Tensor]:
    """Runs with the inputs that are not None (None: left out of the node)."""
    return session.run({n: t for n, t in inputs.items() if t is not None})


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as comparable bits (16-bit floats as int16)."""
    return (t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()


# ------------------------------------------------------------------ ReshapeAndCache


WRITE_CASES = [
    AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1), padded_tokens=3),
    AttentionCase(
        "prefill", (7, 16, 1, 33), (0, 0, 0, 0), num_heads=8, num_kv_heads=1, head_size=40
    ),
    AttentionCase("decode", (1, 1, 1), (5, 16, 31), slot_dtype=torch.int32, block_size=8),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float16, torch.bfloat16, torch.float32])
def test_reshape_and_cache_writes_every_cache_dtype_bit_exact(case, key_dtype, cache_dtype):
    x = make_paged_inputs(case)
    inputs = _write_inputs(x, cache_dtype, key_dtype)
    expected = _expected_caches(inputs)
    _run(_write_session(inputs, case.block_size), inputs)  # in place
    for name, want in expected.items():
        np.testing.assert_array_equal(_bits(inputs[name]), want, err_msg=name)


def _rounding_rows(head_size: int) -> np.ndarray:
    """float32 rows whose quantization depends on the contract's exact arithmetic: x / scale
    exactly half-way between integers (round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2,
    -0.5 -> 0), rows whose x / scale and x * (1 / scale) round differently (IEEE division, not
    a reciprocal multiply), a zero row (scale 0) and a row of one value (q = 127)."""
    halves = np.zeros(head_size, dtype=np.float32)
    halves[:6] = [127.0, 0.5, 1.5, 2.5, -0.5, -126.5]
    rows = [halves, np.zeros(head_size, np.float32), np.full(head_size, -3.0, np.float32)]
    rng = np.random.default_rng(0)
    found = 0
    while found < 4:
        row = rng.standard_normal(head_size).astype(np.float32)
        scale = np.abs(row).max() / np.float32(127)
        k = rng.integers(-120, 120, head_size).astype(np.float32) + np.float32(0.5)
        row = (k * scale).astype(np.float32)
        row[0] = np.float32(127) * scale  # keeps the scale
        scale = np.abs(row).max() / np.float32(127)
        divided = np.rint(row / scale)
        multiplied = np.rint(row * (np.float32(1) / scale))
        if (divided != multiplied).any():
            rows.append(row)
            found += 1
    return np.stack(rows)


def test_reshape_and_cache_quantizes_with_the_contracts_rounding():
    """Round half to even and IEEE division: a kernel that rounds half away from zero or
    multiplies by the reciprocal writes other int8 values for these rows."""
    head_size, kv_heads = 32, 1
    rows = _rounding_rows(head_size)
    tokens = len(rows)
    cache_shape = (-(-tokens // 4), 4, kv_heads, head_size)
    inputs = {
        "key": torch.from_numpy(rows).reshape(tokens, kv_heads, head_size),
        "value": torch.from_numpy(-rows).reshape(tokens, kv_heads, head_size),
        "key_cache": torch.zeros(cache_shape, dtype=torch.int8),
        "value_cache": torch.zeros(cache_shape, dtype=torch.int8),
        "slot_mapping": torch.arange(tokens, dtype=torch.int64),
        "key_scale_cache": torch.zeros(cache_shape[:3]),
        "value_scale_cache": torch.zeros(cache_shape[:3]),
    }
    _write_session(inputs, 4).run(inputs)
    for part, source in (("key", rows), ("value", -rows)):
        q, scale = quantize(source)
        written = inputs[f"{part}_cache"].reshape(-1, head_size)[:tokens].numpy()
        np.testing.assert_array_equal(written, q, err_msg=part)
        scales = inputs[f"{part}_scale_cache"].reshape(-1)[:tokens].numpy()
        np.testing.assert_array_equal(scales, scale, err_msg=part)
    assert inputs["key_cache"].reshape(-1, head_size)[0, :6].tolist() == [127, 0, 2, 2, 0, -126]


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size", [8, 12, 64])  # (8 lanes at a time, or not)
def test_reshape_and_cache_quantizes_non_finite_and_zero_rows_as_the_contract_says(
    head_size, source_dtype
):
    """A NaN makes the row's scale NaN and its values 0; a zero row has scale 0; an infinity
    makes the scale infinite, its own value (inf / inf) 0 and the finite ones 0 (float32 rows
    and float16 ones, widened first)."""
    rows = np.linspace(-3.0, 5.0, 4 * head_size, dtype=np.float32).reshape(4, head_size)
    rows[0, 3] = np.nan
    rows[1] = 0.0
    rows[2, 1] = np.inf
    source = torch.from_numpy(rows).to(source_dtype)
    rows = source.float().numpy()
    tokens, kv_heads = len(rows), 1
    cache_shape = (1, tokens, kv_heads, head_size)
    inputs = {
        "key": source.reshape(tokens, kv_heads, head_size),
        "value": source.reshape(tokens, kv_heads, head_size),
        "key_cache": torch.full(cache_shape, 7, dtype=torch.int8),
        "value_cache": torch.full(cache_shape, 7, dtype=torch.int8),
        "slot_mapping": torch.arange(tokens, dtype=torch.int64),
        "key_scale_cache": torch.zeros(cache_shape[:3]),
        "value_scale_cache": torch.zeros(cache_shape[:3]),
    }
    _write_session(inputs, tokens).run(inputs)
    written = inputs["key_cache"].reshape(tokens, head_size).numpy()
    scales = inputs["key_scale_cache"].reshape(tokens).numpy()
    assert np.isnan(scales[0]) and scales[1] == 0 and scales[2] == np.inf
    assert not written[:3].any()
    q, scale = quantize(rows[3:])
    np.testing.assert_array_equal(written[3:], q)
    np.testing.assert_array_equal(scales[3:], scale)


def test_reshape_and_cache_int8_without_binding_returns_new_caches():
    """Outputs not bound to the caches: onnxruntime allocates them and the kernel copies the
    caches (scale caches included) before writing the new rows."""
    case = WRITE_CASES[0]
    inputs = _write_inputs(make_paged_inputs(case), torch.int8, torch.float32)
    expected = _expected_caches(inputs)
    before = {n: t.clone() for n, t in inputs.items()}
    session = _write_session(inputs, case.block_size).session
    feeds = {n: t.numpy() for n, t in inputs.items()}
    outputs = dict(
        zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
    )
    for name, want in expected.items():
        np.testing.assert_array_equal(outputs[f"{name}_out"], want, err_msg=name)
        assert torch.equal(inputs[name], before[name])  # the inputs were not written


# ------------------------------------------------------------------ PagedAttention


def _cache_inputs(x: dict, cache_dtype: torch.dtype) -> dict:
    """x's caches with the new rows written, as ``cache_dtype`` (int8: quantized per the
    contract, with scale caches), and the float32 caches they stand for (dequantized)."""
    slots = x["slot_mapping"].to(torch.int64)
    keep = slots >= 0
    inputs, floats = {}, {}
    for part in ("key", "value"):
        cache = x[f"{part}_cache"].to(torch.float32).clone()
        cache.view(-1, *cache.shape[2:])[slots[keep]] = x[part][keep].to(torch.float32)
        if cache_dtype == torch.int8:
            q, scale = quantize(cache.numpy())
            inputs[f"{part}_cache"] = torch.from_numpy(q)
            inputs[f"{part}_scale_cache"] = torch.from_numpy(scale)
            floats[part] = dequantize(q, scale)
        else:
            inputs[f"{part}_cache"] = cache.to(cache_dtype)
            floats[part] = inputs[f"{part}_cache"].to(torch.float32).numpy()
    return inputs, floats


LONG = AttentionCase("long", (1, 1, 5, 1), (1000, 600, 20, 0), head_size=64)
ATTENTION_CASES = [
    AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
    AttentionCase("prefill", (7, 16, 1, 33), (0, 0, 0, 0), alibi=True, head_size=40),
    AttentionCase("decode", (1, 1, 1, 1, 1), (5, 16, 31, 64, 100), logits_soft_cap=5.0),
    AttentionCase("chunked", (8, 20), (24, 7), sliding_window=9, num_heads=8, num_kv_heads=1),
    AttentionCase("chunked", (8, 20), (24, 7), causal=False, num_heads=6, num_kv_heads=3),
    LONG,
    LONG.with_(alibi=True, num_heads=12, num_kv_heads=4),
    LONG.with_(sliding_window=300, head_size=40, logits_soft_cap=5.0),
    LONG.with_(num_heads=8, num_kv_heads=1, causal=False, block_size=8),
    # the tiled prefill: a prompt and a prefill chunk over several tiles and chunks of keys
    AttentionCase("long-prefill", (300, 1, 130), (0, 40, 150), 9, 3, 64, sliding_window=200),
    # past the kernel's kStreamBytes (8 MiB of decode rows, int8 included): one item per
    # sequence (split) reads every KV head of its chunks
    AttentionCase(
        "stream", (1, 1, 1), (9000, 5000, 300), num_heads=8, num_kv_heads=4, head_size=128
    ).with_(alibi=True, logits_soft_cap=30.0),
]
QUERY_CACHE_DTYPES = [
    (torch.float32, torch.int8),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.int8),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),
]


def _attention_inputs(
    case: AttentionCase, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> tuple[dict, np.ndarray]:
    """PagedAttention's inputs for ``case`` (queries in ``query_dtype``, caches of
    ``cache_dtype``) and the float64 reference output over the caches they stand for."""
    x = make_paged_inputs(case)
    caches, floats = _cache_inputs(x, cache_dtype)
    slopes = x["kwargs"]["alibi_slopes"]
    inputs = {
        "query": x["query"].to(query_dtype),
        "key_cache": caches["key_cache"],
        "value_cache": caches["value_cache"],
        "block_tables": x["block_tables"],
        "seq_lens": x["seq_lens"],
        "query_start_loc": x["query_start_loc"],
        "alibi_slopes": slopes if slopes is not None else torch.zeros(case.num_heads),
        "key_scale_cache": caches.get("key_scale_cache"),
        "value_scale_cache": caches.get("value_scale_cache"),
    }
    expected = attention(
        inputs["query"].to(torch.float32).numpy(),
        floats["key"],
        floats["value"],
        x["block_tables"].numpy(),
        x["seq_lens"].numpy(),
        x["query_start_loc"].numpy(),
        scale=x["kwargs"]["scale"],
        causal=case.causal,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
        alibi_slopes=None if slopes is None else slopes.numpy(),
    )
    return inputs, expected


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize(
    "query_dtype, cache_dtype",
    QUERY_CACHE_DTYPES,
    ids=[f"{str(q)[6:]}-over-{str(c)[6:]}" for q, c in QUERY_CACHE_DTYPES],
)
def test_paged_attention_over_a_cache_of_another_dtype(case, query_dtype, cache_dtype):
    inputs, expected = _attention_inputs(case, query_dtype, cache_dtype)
    out = _run(_attention_session(inputs, case), inputs)["output"]
    assert out.dtype == query_dtype and out.shape == inputs["query"].shape
    torch.testing.assert_close(
        out.to(torch.float64), torch.from_numpy(expected), **tolerance(query_dtype)
    )


# ------------------------------------------------------------------ prefill_bf16

BF16_CASES = [
    ATTENTION_CASES[0].with_(head_size=64),  # prefills (tiles) and decodes in one batch
    ATTENTION_CASES[9],  # prompts and a chunk over several tiles and chunks of keys
    ATTENTION_CASES[9].with_(alibi=True, logits_soft_cap=5.0, sliding_window=-1, head_size=128),
    LONG.with_(query_lens=(1, 40, 5, 1)),  # decodes past a chunk of keys, two prefills
]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32], ids=str)
def test_paged_attention_prefill_bf16_rounds_only_the_prefills(case, cache_dtype):
    """prefill_bf16 = 1: within bfloat16's tolerance of the float64 reference; the decode rows
    (sequences of one query) bit-equal to the float32 kernel's; the prefill rows differ from
    them where the CPU has AVX512_BF16 (the pairs ran) and equal them elsewhere (ignored)."""
    inputs, expected = _attention_inputs(case, torch.float32, cache_dtype)
    exact = _run(_attention_session(inputs, case), inputs)["output"]
    paired = _run(_attention_session(inputs, case, prefill_bf16=1), inputs)["output"]
    torch.testing.assert_close(
        paired.to(torch.float64), torch.from_numpy(expected), **tolerance(torch.bfloat16)
    )
    starts = inputs["query_start_loc"].tolist()
    prefill = torch.zeros(len(paired), dtype=torch.bool)
    for begin, end in itertools.pairwise(starts):
        prefill[begin:end] = end - begin > 1
    assert torch.equal(paired[~prefill], exact[~prefill])
    if bf16_pairs_run(case.head_size):
        assert not torch.equal(paired[prefill], exact[prefill])
        # bfloat16's rounding, not float32's: far from the float32 kernel's error
        assert (paired[prefill] - exact[prefill]).abs().max() > 1e-4
    else:
        assert torch.equal(paired[prefill], exact[prefill])


# ------------------------------------------------------------------ named errors


def _int8_attention_inputs() -> tuple[dict, AttentionCase]:
    case = ATTENTION_CASES[0]
    return _attention_inputs(case, torch.float32, torch.int8)[0], case


def _apply(change: dict, inputs: dict) -> None:
    """Replaces inputs as a bad-scale case says: a tensor or None as given, "half" the input
    in float16, "float" the input and the value cache in float32 (float caches)."""
    for name, new in change.items():
        if new == "half":
            new = inputs[name].half()
        elif new == "float":
            inputs["value_cache"] = inputs["value_cache"].float()
            new = inputs[name].float()
        inputs[name] = new


@pytest.mark.parametrize(
    "change, message",
    [
        ({"key_scale_cache": None, "value_scale_cache": None}, r"int8 caches need key_scale_cache"),
        ({"value_scale_cache": None}, r"int8 caches need value_scale_cache \(input 8\)"),
        (
            {"key_scale_cache": torch.zeros(3, 16, 2)},
            r"key_scale_cache: expected \[num_blocks, block_size, num_kv_heads\]",
        ),
        ({"value_scale_cache": "half"}, r"value_scale_cache: expected float32, got float16"),
        ({"key_cache": "float"}, r"key_scale_cache \(input 7\) is given with float32 caches"),
    ],
)
def test_paged_attention_names_a_bad_scale_cache(change, message):
    inputs, case = _int8_attention_inputs()
    _apply(change, inputs)
    session = _attention_session(inputs, case)
    with pytest.raises(Exception, match=message):
        _run(session, inputs)


def test_paged_attention_takes_float_caches_with_absent_scale_names():
    """Nine inputs whose last two are the empty name "" run as seven (float caches)."""
    case = ATTENTION_CASES[0]
    x = make_paged_inputs(case)
    inputs = {n: x[n] for n in ("query", "key_cache", "value_cache", "block_tables")}
    inputs |= {n: x[n] for n in ("seq_lens", "query_start_loc")}
    inputs |= {"alibi_slopes": torch.zeros(case.num_heads)}
    seven = _run(_attention_session(inputs, case), inputs)["output"]
    nine = inputs | {"key_scale_cache": None, "value_scale_cache": None}
    assert torch.equal(_run(_attention_session(nine, case), nine)["output"], seven)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"key_scale_cache": None, "value_scale_cache": None}, r"int8 caches need key_scale_cache"),
        (
            {"value_scale_cache": torch.zeros(1, 16, 2)},
            r"value_scale_cache: expected \[num_blocks, block_size, num_kv_heads\]",
        ),
        ({"key_scale_cache": "half"}, r"key_scale_cache: expected float32, got float16"),
        ({"key_cache": "float"}, r"key_scale_cache \(input 5\) is given with float32 caches"),
    ],
)
def test_reshape_and_cache_names_a_bad_scale_cache(change, message):
    case = WRITE_CASES[0]
    inputs = _write_inputs(make_paged_inputs(case), torch.int8, torch.float32)
    _apply(change, inputs)
    session = _write_session(inputs, case.block_size)
    with pytest.raises(Exception, match=message):
        _run(session, inputs)

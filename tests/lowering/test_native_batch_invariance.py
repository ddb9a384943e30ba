"""A query row's PagedAttention output from the native kernel does not depend on what else its
step holds: a decode row alone equals the same row beside other sequences (short contexts,
long ones that the kernel splits across threads, and a batch big enough to stream its caches),
and a prefill row equals itself whatever chunk of its prompt, and whatever other prompts, it
runs with. Bit for bit: a quantized model rounds its activations to int8 steps, and a greedy
token can follow a last-bit difference (a decode alone once split its softmax sums in two
where the same decode batched did not)."""

from __future__ import annotations

import pytest
import torch

from attnexport.lowering.single_node import single_node_session
from tests.helpers import requires_ort_kernels

pytestmark = requires_ort_kernels

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention
NUM_BLOCKS = 320


@pytest.fixture(scope="module")
def caches():
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_SIZE)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _attention(caches, sequences) -> list[torch.Tensor]:
    """Each sequence's output rows of one native PagedAttention step over ``sequences``:
    ``(first block id, seq_len, queries [q, heads, head_size])``, blocks laid out contiguously."""
    queries = torch.cat([q for _, _, q in sequences])
    width = max(-(-length // BLOCK) for _, length, _ in sequences)
    tables = torch.zeros(len(sequences), width, dtype=torch.int32)
    starts = [0]
    for i, (first, length, q) in enumerate(sequences):
        blocks = -(-length // BLOCK)
        tables[i, :blocks] = torch.arange(first, first + blocks, dtype=torch.int32)
        starts.append(starts[-1] + q.shape[0])
    inputs = {
        "query": queries,
        "key_cache": caches[0],
        "value_cache": caches[1],
        "block_tables": tables,
        "seq_lens": torch.tensor([length for _, length, _ in sequences], dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "alibi_slopes": torch.zeros(HEADS),
    }
    session = single_node_session(
        "PagedAttention",
        inputs,
        {"output": queries},
        "native",
        scale=HEAD_SIZE**-0.5,
        causal=1,
        sliding_window=-1,
        logits_soft_cap=0.0,
    )
    out = session.run(inputs)["output"]
    return [out[starts[i] : starts[i + 1]] for i in range(len(sequences))]


def _queries(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, HEADS, HEAD_SIZE, generator=generator)


@pytest.mark.parametrize("length", [40, 600, 1500])
def test_a_decode_row_alone_equals_it_batched(caches, length):
    """600 and 1500 keys: the kernel splits the context across threads; the split depends on
    the context's length, not on the batch (it once did: alone split, batched not)."""
    row = _queries(1, 1)
    alone = _attention(caches, [(0, length, row)])[0]
    pair = [(100, 500, _queries(1, 2)), (150, 700, _queries(1, 3))]
    beside_two = _attention(caches, [*pair, (0, length, row)])[-1]
    # 5 x 1500 keys: past the kernel's streaming threshold (items take every KV head).
    streamed = [(100, 1500, _queries(1, 10 + i)) for i in range(5)]
    beside_five = _attention(caches, [(0, length, row), *streamed])[0]
    assert torch.equal(alone, beside_two)
    assert torch.equal(alone, beside_five)


@pytest.mark.parametrize("length", [100, 600])
def test_a_prefill_row_is_the_same_in_any_chunk_and_batch(caches, length):
    rows = _queries(48, 4)
    last_of_48 = _attention(caches, [(0, length, rows)])[0][-1]
    last_of_2 = _attention(caches, [(0, length, rows[-2:])])[0][-1]
    beside = _attention(caches, [(200, 30, _queries(30, 5)), (0, length, rows[-17:])])[1][-1]
    assert torch.equal(last_of_48, last_of_2)
    assert torch.equal(last_of_48, beside)

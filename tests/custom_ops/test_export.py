"""torch.export of a module built on the ops, with every batch dimension dynamic."""

from __future__ import annotations

import torch
from torch.export import Dim

import attnexport
from tests.attention_cases import AttentionCase, make_paged_inputs, make_varlen_inputs
from tests.helpers import layer_args


class PagedBlock(torch.nn.Module):
    """Writes new keys/values, attends over the cache, then self-attends the queries (varlen)."""

    def __init__(self, scale: float, alibi_slopes: torch.Tensor):
        super().__init__()
        self.scale = scale
        self.register_buffer("alibi_slopes", alibi_slopes)

    def forward(
        self,
        query,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
    ):
        attnexport.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        paged = attnexport.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            self.scale,
            alibi_slopes=self.alibi_slopes,
            sliding_window=6,
            logits_soft_cap=3.0,
        )
        local = attnexport.varlen_attention(
            query, key, value, query_start_loc, query_start_loc, self.scale, causal=True
        )
        return paged + local


def _inputs(query_lens, context_lens, seed):
    case = AttentionCase(
        "export", query_lens, context_lens, num_heads=4, num_kv_heads=2, alibi=True
    )
    x = make_paged_inputs(case, seed=seed)
    args = layer_args(x)
    return case, args


def _dynamic_shapes():
    tokens, seqs = Dim("num_tokens", min=2), Dim("num_seqs", min=2)
    blocks, width = Dim("num_blocks", min=2), Dim("max_blocks_per_seq", min=2)
    token_dim, cache = {0: tokens}, {0: blocks}
    return {
        "query": token_dim,
        "key": token_dim,
        "value": token_dim,
        "key_cache": cache,
        "value_cache": cache,
        "slot_mapping": token_dim,
        "block_tables": {0: seqs, 1: width},
        "seq_lens": {0: seqs},
        "query_start_loc": {0: seqs + 1},
    }


def test_export_keeps_ops_and_matches_eager_on_new_shapes():
    case, sample = _inputs((3, 1, 4), (5, 20, 0), seed=0)
    module = PagedBlock(
        case.head_size**-0.5, attnexport.custom_ops.alibi.alibi_slopes(case.num_heads)
    )
    program = torch.export.export(module, sample, dynamic_shapes=_dynamic_shapes())

    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("attnexport.reshape_and_cache.default") == 1
    assert targets.count("attnexport.paged_attention.default") == 1
    assert targets.count("attnexport.varlen_attention.default") == 1
    shapes = [n.meta["val"].shape for n in program.graph.nodes if n.op == "placeholder"]
    assert all(not isinstance(d, int) for d in shapes[-1])  # query_start_loc stays symbolic

    for query_lens, context_lens in (
        ((1, 1, 1, 1, 1, 1), (9, 3, 40, 17, 2, 64)),
        ((17, 2), (0, 33)),
    ):
        _, args = _inputs(query_lens, context_lens, seed=1)
        eager_args = [a.clone() for a in args]
        exported_args = [a.clone() for a in args]
        expected = module(*eager_args)
        actual = program.module()(*exported_args)
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        # The cache write happened in place on the exported side too.
        torch.testing.assert_close(exported_args[3], eager_args[3], atol=0, rtol=0)
        torch.testing.assert_close(exported_args[4], eager_args[4], atol=0, rtol=0)


def test_export_varlen_with_separate_key_lengths():
    class Encoder(torch.nn.Module):
        def forward(self, query, key, value, cu_q, cu_k):
            return attnexport.varlen_attention(query, key, value, cu_q, cu_k, 0.25)

    def inputs(query_lens, context_lens):
        x = make_varlen_inputs(AttentionCase("enc", query_lens, context_lens, causal=False))
        return (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])

    seqs = Dim("num_seqs", min=2)
    q_tokens, k_tokens = Dim("num_query_tokens", min=2), Dim("num_key_tokens", min=2)
    dynamic = ({0: q_tokens}, {0: k_tokens}, {0: k_tokens}, {0: seqs + 1}, {0: seqs + 1})
    program = torch.export.export(Encoder(), inputs((2, 3), (1, 4)), dynamic_shapes=dynamic)
    args = inputs((5, 1, 7), (0, 9, 2))
    torch.testing.assert_close(program.module()(*args), Encoder()(*args), atol=0, rtol=0)

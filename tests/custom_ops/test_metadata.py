"""AttentionMetadata built from per-sequence state."""

from __future__ import annotations

import pytest
import torch

import attnexport
from attnexport.custom_ops import ScheduledSequence, build_attention_metadata, reference


def test_builds_slots_tables_and_counts():
    seqs = [
        ScheduledSequence(num_cached_tokens=5, num_new_tokens=1, block_ids=[7, 2]),  # decode
        ScheduledSequence(num_cached_tokens=0, num_new_tokens=3, block_ids=[4]),  # prefill
        ScheduledSequence(num_cached_tokens=4, num_new_tokens=2, block_ids=[1, 3]),  # chunk
    ]
    md = build_attention_metadata(seqs, block_size=4)
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, 12, 13]
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_tables.tolist() == [[7, 2], [4, 0], [1, 3]]
    assert md.block_tables.dtype == torch.int32
    assert md.seq_lens.tolist() == [6, 3, 6]
    assert md.query_start_loc.tolist() == [0, 1, 4, 6]
    assert (md.max_query_len, md.max_seq_len) == (3, 6)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 5, 1)
    assert md.num_seqs == 3 and md.num_tokens == 6 and not md.is_encoder_decoder


def test_encoder_decoder_fields():
    seqs = [
        ScheduledSequence(0, 2, [0], encoder_len=5, encoder_block_ids=[3, 4], encode_now=True),
        ScheduledSequence(3, 1, [1], encoder_len=2, encoder_block_ids=[5], encode_now=False),
    ]
    md = build_attention_metadata(seqs, block_size=4)
    assert md.is_encoder_decoder
    assert md.encoder_seq_lens.tolist() == [5, 2]
    assert md.encoder_start_loc.tolist() == [0, 5, 5]
    assert md.cross_slot_mapping.tolist() == [12, 13, 14, 15, 16]
    assert md.cross_block_tables.tolist() == [[3, 4], [5, 0]]
    assert md.max_encoder_seq_len == 5


def test_rejects_blocks_that_do_not_cover_the_tokens():
    with pytest.raises(ValueError, match=r"sequences\[0\]: 1 blocks of 4 tokens cannot hold 5"):
        build_attention_metadata([ScheduledSequence(4, 1, [0])], block_size=4)


def test_metadata_drives_the_ops():
    """A step built by the builder runs through the ops and matches the reference."""
    torch.manual_seed(0)
    seqs = [ScheduledSequence(3, 1, [2]), ScheduledSequence(0, 5, [0, 1])]
    md = build_attention_metadata(seqs, block_size=4)
    key_cache, value_cache = torch.randn(2, 4, 4, 2, 8).unbind(0)
    key, value, query = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 4, 8)
    attnexport.reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping)
    args = (query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3)
    torch.testing.assert_close(
        attnexport.paged_attention(*args),
        reference.paged_attention(*args).float(),
        atol=1e-5,
        rtol=1e-5,
    )

"""swap_blocks and copy_blocks on caches in the standard layout."""

from __future__ import annotations

import pytest
import torch

import attnexport


def _cache(num_blocks: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_blocks, 4, 2, 8).to(device=device, dtype=dtype)


def _devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("dst_device", _devices())
def test_swap_blocks_moves_whole_blocks(dst_device):
    src, dst = _cache(6), _cache(3, dst_device)
    untouched = dst[1].clone()
    mapping = torch.tensor([[4, 0], [1, 2]], dtype=torch.int64)
    attnexport.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[0].cpu(), src[4]) and torch.equal(dst[2].cpu(), src[1])
    assert torch.equal(dst[1], untouched)
    back = _cache(6)
    attnexport.swap_blocks(dst, back, torch.tensor([[0, 5]]))
    assert torch.equal(back[5], src[4])


def test_copy_blocks_applies_to_every_cache():
    caches = [_cache(5), _cache(5, dtype=torch.bfloat16)]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [2, 4]])
    attnexport.copy_blocks(caches, mapping)
    for cache, original in zip(caches, expected, strict=True):
        original[3], original[4] = original[0].clone(), original[2].clone()
        assert torch.equal(cache, original)


@pytest.mark.parametrize(
    "mapping,message",
    [
        (torch.tensor([[0, 1]], dtype=torch.int32), "src_to_dst: expected dtype torch.int64"),
        (torch.tensor([0, 1]), r"src_to_dst: expected shape \[n, 2\]"),
        (torch.tensor([[9, 1]]), r"source block 9 is out of range; expected ids in \[0, 6\)"),
        (torch.tensor([[0, 3]]), r"destination block 3 is out of range; expected ids in \[0, 3\)"),
        (torch.tensor([[0, 1], [2, 1]]), "distinct destination blocks"),
    ],
)
def test_swap_blocks_rejects_bad_mappings(mapping, message):
    error = TypeError if mapping.dtype != torch.int64 else ValueError
    with pytest.raises(error, match=message):
        attnexport.swap_blocks(_cache(6), _cache(3), mapping)


def test_swap_blocks_rejects_mismatched_caches():
    with pytest.raises(ValueError, match="dst_cache: expected block shape"):
        attnexport.swap_blocks(_cache(2), torch.zeros(2, 8, 2, 8), torch.tensor([[0, 0]]))
    with pytest.raises(TypeError, match=r"dst_cache: expected dtype torch\.float32"):
        attnexport.swap_blocks(_cache(2), _cache(2, dtype=torch.float16), torch.tensor([[0, 0]]))

"""Freed blocks are reused before never-used ones, so the blocks a pool ever held are those its
peak load needed."""

from __future__ import annotations

from attnexport.runtime.block_manager import BlockPool


def test_freed_blocks_are_reused_before_blocks_never_used():
    """Handed out in id order, never-used blocks first, the pool touched every block of a
    long-running server even when it never held more than a few at once."""
    pool = BlockPool(8)
    first = [pool.allocate() for _ in range(3)]
    assert first == [0, 1, 2] and pool.high_water == 3 and pool.num_free == 5
    pool.decref(1)
    pool.decref(0)
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [0, 1, 3]
    assert pool.high_water == 4 and pool.num_free == 4

"""The KV pool's memory is committed as blocks are used, not when the pool is made: a pool
sized for the worst case costs what its sequences use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from attnexport.model_interface import CacheSpec
from attnexport.runtime.block_manager import BlockPool
from attnexport.runtime.executors.cache_pool import NumpyCachePool

MIB = 2**20
# 30 layers, 3 KV heads of 64 (SmolLM2-135M): 720 KiB per block.
SPEC = CacheSpec(num_layers=30, num_kv_heads=3, head_size=64, dtype=np.dtype("float32"))


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_numpy_pool_commits_its_memory_as_blocks_are_touched():
    """The pool wrote zeros through all its memory when it was made: `run` committed a quarter
    of the machine's memory for a 16-token chat."""
    before = _rss()
    pool = NumpyCachePool(SPEC, num_blocks=512, num_cpu_blocks=64)  # 360 MiB + 45 MiB
    assert _rss() - before < 16 * MIB
    pool.touch(32)
    used = 32 * SPEC.bytes_per_block
    huge_pages = len(pool.kv_caches) * 2 * MIB  # at most one 2 MiB page more per tensor
    assert 0.9 * used < _rss() - before < used + huge_pages + 16 * MIB
    assert pool.num_touched_blocks == 32
    assert not any(cache.any() for cache in pool.kv_caches)


_MAKE_A_POOL = """
import numpy as np
from attnexport.model_interface import CacheSpec
from attnexport.runtime.executors.cache_pool import NumpyCachePool

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

before = rss()
spec = CacheSpec(num_layers=30, num_kv_heads=3, head_size=64, dtype=np.dtype("float32"))
pool = NumpyCachePool(spec, num_blocks=512, num_cpu_blocks=64)
print(rss() - before)
"""


def test_the_pool_stays_uncommitted_whatever_the_allocators_state():
    """The pool was np.zeros (calloc), lazy only while malloc hands out fresh pages: in the
    full test run, a long-lived process, calloc reused freed heap memory and wrote zeros through
    it (+292 MB at construction). glibc's MALLOC_PERTURB_ makes calloc write through every
    allocation: the same dependence, made deterministic (+405 MiB before the fix)."""
    done = subprocess.run(
        [sys.executable, "-c", _MAKE_A_POOL],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "MALLOC_PERTURB_": "165"},
    )
    assert int(done.stdout.split()[-1]) < 16 * MIB


def test_touching_keeps_what_blocks_hold():
    """Whatever wrote a block before it was touched (a copy-on-write copy, a swap-in) keeps
    its values."""
    pool = NumpyCachePool(SPEC, num_blocks=64, num_cpu_blocks=4)
    pool.kv_caches[0][3] = 1.5
    pool.touch(8)
    assert float(pool.kv_caches[0][3].min()) == 1.5
    pool.copy_blocks([(3, 40)])  # a destination never touched
    pool.touch(60)
    assert float(pool.kv_caches[0][40].min()) == 1.5 and not pool.kv_caches[1].any()
    assert pool.num_touched_blocks == 60


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

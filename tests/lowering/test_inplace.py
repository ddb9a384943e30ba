"""The cache write updates the bound buffer in place: O(new tokens), not O(cache).

Proof without timing: the cache is a 1 GiB allocation whose pages the OS has not committed yet
(``torch.empty``). A step that copied the cache (a plain ``run``, or a graph whose ScatterND does
not write into its input) would touch every page and grow the resident set by ~1 GiB; an
in-place step touches only the blocks it writes and reads. Also: the output OrtValue onnxruntime
returns is the cache's own buffer. Timings are in benchmarks/ort_cache_update.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from attnexport.lowering import PagedOrtSession, export_program, to_onnx
from tests.lowering.modules import PagedAttentionOnly, StepPlanner, attention_inputs

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_SIZE = 16, 4, 2, 32
BLOCK_BYTES = BLOCK_SIZE * KV_HEADS * HEAD_SIZE * 4
HUGE_BLOCKS = 2**30 // BLOCK_BYTES  # 1 GiB per cache tensor

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the resident set from /proc"
)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _step_inputs(num_blocks: int, plan: dict[int, int] | None = None) -> dict:
    # Blocks near the end of the cache, so that a copy could not hide in touched pages.
    planner = StepPlanner(num_blocks, BLOCK_SIZE)
    planner.free = list(range(num_blocks - 8, num_blocks))
    step = planner.step(plan or {0: 5, 1: 1}, padding=2)
    return attention_inputs(step, 2, heads=HEADS, kv_heads=KV_HEADS, head_size=HEAD_SIZE)


@pytest.fixture(scope="module")
def program():
    sample = _step_inputs(8, {0: 20, 1: 3})
    caches = [torch.zeros(8, BLOCK_SIZE, KV_HEADS, HEAD_SIZE) for _ in range(2)]
    return export_program(PagedAttentionOnly(), (*sample.values(), *caches))


@pytest.mark.parametrize("target", ["attnexport", "standard"])
def test_cache_write_touches_only_the_written_blocks(program, tmp_path, target):
    to_onnx(program, (), tmp_path / "m.onnx", target=target)
    session = PagedOrtSession(tmp_path / "m.onnx")
    small = [torch.zeros(16, BLOCK_SIZE, KV_HEADS, HEAD_SIZE) for _ in range(2)]
    session.run({**_step_inputs(16), "key_cache": small[0], "value_cache": small[1]})  # warm-up

    inputs = _step_inputs(HUGE_BLOCKS)
    caches = [torch.empty(HUGE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE) for _ in range(2)]
    before = _resident_bytes()
    step = session.bind({**inputs, "key_cache": caches[0], "value_cache": caches[1]})
    values = step.run()
    grown = _resident_bytes() - before

    outputs = dict(zip(session.output_names, values, strict=True))
    assert outputs["key_cache_out"].data_ptr() == caches[0].data_ptr()
    assert outputs["value_cache_out"].data_ptr() == caches[1].data_ptr()
    assert grown < 64 * 2**20, f"the step touched {grown / 2**20:.0f} MiB of 2 GiB of caches"
    # The write landed: slot of token 0 of sequence 0.
    slot = int(inputs["slot_mapping"][0])
    torch.testing.assert_close(
        caches[0][slot // BLOCK_SIZE, slot % BLOCK_SIZE], inputs["key"][0], atol=0, rtol=0
    )


def test_a_plain_run_copies_the_cache(program, tmp_path):
    """The control: without IO binding the same graph allocates fresh cache outputs."""
    to_onnx(program, (), tmp_path / "m.onnx")
    session = PagedOrtSession(tmp_path / "m.onnx")
    inputs = _step_inputs(64)
    caches = [torch.zeros(64, BLOCK_SIZE, KV_HEADS, HEAD_SIZE) for _ in range(2)]
    feeds = {k: v.numpy() for k, v in {**inputs, "key_cache": caches[0]}.items()}
    feeds["value_cache"] = caches[1].numpy()
    key_out = session.session.run(["key_cache_out"], feeds)[0]
    assert not caches[0].any(), "a plain run must not write the input"
    assert key_out.any()

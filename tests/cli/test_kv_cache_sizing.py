"""`run` sizes its KV pool from its requests (it knows them) or from --kv-cache-memory, and
commits the pool's memory as it is used; `serve` says how large its pool is when it starts."""

from __future__ import annotations

import pytest

import attnexport.runtime
from tests.cli.helpers import assert_one_line_error, run_cli, stop_before_serving


@pytest.fixture
def engines(monkeypatch):
    """The engines ``run`` builds in this test."""
    built = []
    original = attnexport.runtime.engine_from_path

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(attnexport.runtime, "engine_from_path", recording)
    return built


def test_run_sizes_its_pool_from_its_requests(llama_export, engines, capsys):
    """It took max_num_seqs sequences of max_model_len (64 x 2048 tokens), at most a quarter
    of the machine's memory (7.1 GB for one 16-token chat on a 135M model)."""
    prompts = ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8"]
    code, _, err = run_cli(capsys, "run", llama_export, *prompts, "--max-tokens", 14, "--json")
    assert code == 0, err
    (engine,) = engines
    block_size = engine.executor.cache_spec.block_size
    assert block_size == 16
    # 3 + 14 = 17 tokens (2 blocks) and 5 + 14 = 19 tokens (2 blocks)
    assert engine.num_blocks == 4


def test_run_kv_cache_memory_sets_the_pool(llama_export, engines, capsys):
    code, _, err = run_cli(
        capsys, "run", llama_export, "--prompt-ids", "1,2,3", "--kv-cache-memory", 0.001
    )
    assert code == 0, err
    per_block = engines[0].executor.cache_spec.bytes_per_block
    assert engines[0].num_blocks == int(0.001 * 2**30) // per_block


@pytest.mark.parametrize(
    "gib,needle",
    [
        (0, "--kv-cache-memory: expected a size in GiB > 0, got 0.0"),
        ("inf", "--kv-cache-memory: expected a size in GiB > 0, got inf"),
        (1e-6, "cannot hold one sequence of 19 (its longest) tokens"),
    ],
)
def test_run_refuses_a_kv_cache_memory_that_cannot_work(llama_export, capsys, gib, needle):
    flags = ["--prompt-ids", "1,2,3", "--max-tokens", 16, "--kv-cache-memory", gib]
    code, _, err = run_cli(capsys, "run", llama_export, *flags)
    assert code == 2
    assert_one_line_error(err, "run", needle)


def test_serve_says_how_large_its_pool_is_at_start(llama_export, monkeypatch, capsys):
    pytest.importorskip("fastapi", reason="needs the serve extra")
    stop_before_serving(monkeypatch)
    code, _, err = run_cli(capsys, "serve", llama_export, "--kv-cache-memory", 0.01)
    assert code == 130, err
    assert "KV cache: " in err and " blocks of 16 tokens (" in err and "MiB)" in err
    assert "max_model_len 2048" in err

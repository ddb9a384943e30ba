"""A request the engine fails answers by whose fault it was, carried on the output
(``RequestOutput.error_is_internal``), not guessed from the message: the executor failing is a
500, a request larger than the KV pool a 400."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra")
pytest.importorskip("httpx", reason="needs the dev extra (httpx, for the test client)")

from fastapi.testclient import TestClient

from attnexport.runtime import CacheConfig, Engine, SchedulerConfig
from attnexport.serve.app import create_app
from attnexport.serve.served_model import ServedModel
from tests.runtime.test_streams import FaultyExecutor


class RenamedFailure(RuntimeError):
    pass


def _client(num_blocks: int = 48, fail_at: int = 1) -> TestClient:
    # The executor fails (fail_at 0: never) with a message unlike any the server knows.
    executor = FaultyExecutor(RenamedFailure("device lost"), fail_at)
    engine = Engine(executor, CacheConfig(num_blocks=num_blocks), SchedulerConfig(max_model_len=32))
    return TestClient(create_app(ServedModel("faulty", engine, tokenizer=None)))


def test_an_executor_failure_is_a_500_and_a_request_too_large_for_the_pool_a_400():
    with _client() as client:
        response = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert response.status_code == 500, response.text
        assert "device lost" in response.json()["error"]["message"]
    with _client(
        num_blocks=16, fail_at=0
    ) as client:  # 2-token blocks: two samples of 30 need 30 blocks
        body = {"prompt": [1] * 20, "max_tokens": 10, "n": 2}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert "more KV-cache blocks" in response.json()["error"]["message"]


def test_every_streamed_completion_chunk_names_its_finish_reason_null_until_the_last():
    """Completion chunks left ``finish_reason`` out until the last, where OpenAI (and this
    server's chat chunks) send null."""
    import json

    # (How many chunks the tokens come in depends on how the driver and the client interleave;
    # with 24 tokens there are several, and every one must carry the key.)
    body = {"prompt": [1, 2, 3], "max_tokens": 24, "stream": True}
    with _client(fail_at=0) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    reasons = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines]
    assert reasons and reasons[-1] == "length", reasons
    assert all(reason is None for reason in reasons[:-1]), reasons

"""Scale-out on a local Ray instance: a Ray Serve application of 2 server replicas behind Ray's
one HTTP endpoint answers concurrent openai clients, from both replicas, with each request's
solo tokens. Opt-in: skipped without the ``ray`` extra."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="needs the dev extra (the openai client)")
ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'attnexport[ray]')")
serve = pytest.importorskip("ray.serve", reason="needs ray[serve]")

from attnexport.runtime import SamplingParams, engine_from_path  # noqa: E402
from attnexport.serve.ray_app import ray_application  # noqa: E402
from tests.serve.conftest import KV_CACHE_BYTES  # noqa: E402
from tests.serve.helpers import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url(chat_export):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_application(
            chat_export[0],
            num_replicas=2,
            num_cpus_per_replica=0.5,
            kv_cache_bytes=KV_CACHE_BYTES,
            num_threads=1,
        )
        serve.run(app, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_ray_replicas_serve_one_endpoint(ray_url, chat_export):
    artifact, tokenizer = chat_export
    prompts = [f"Hello world {i}" for i in range(16)]
    engine = engine_from_path(artifact)
    params = SamplingParams(max_tokens=24, stop_token_ids=(tokenizer.eos_token_id,))
    solo = [engine.generate([tokenizer(p)["input_ids"]], params)[0].token_ids for p in prompts]

    async def one(client, prompt):
        response = await client.completions.create(
            model="export", prompt=prompt, max_tokens=24, extra_body={"return_token_ids": True}
        )
        return response.system_fingerprint, response.choices[0].token_ids

    async def all_clients():
        client = openai.AsyncOpenAI(
            base_url=f"{ray_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=120
            )

    replicas = set()

    def both_replicas_answered() -> bool:
        results = asyncio.run(all_clients())
        assert [tokens for _, tokens in results] == solo
        replicas.update(fingerprint for fingerprint, _ in results)
        return len(replicas) == 2

    wait_for(both_replicas_answered, timeout=120, what="answers from both replicas")

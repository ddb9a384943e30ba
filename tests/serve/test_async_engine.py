"""The AsyncEngine alone: many coroutines share one driver thread; each request's stream holds
exactly its solo tokens; an abort from another thread ends its request with "aborted" and
frees its blocks before the driver's next step; a closed stream does the same."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra")

from attnexport.runtime import CacheConfig, SamplingParams, engine_from_path
from attnexport.serve.async_engine import AsyncEngine, EngineStoppedError

PROMPTS = [[0, 5, 6, 7], [0, 9], [0, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]]


def _engine(artifact):
    return engine_from_path(artifact, cache_config=CacheConfig(num_blocks=2048))


def _collect(outputs) -> list[int]:
    return [t for o in outputs for t in o.outputs[0].new_token_ids]


def test_concurrent_streams_get_their_solo_tokens(chat_export):
    artifact = chat_export[0]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.7, seed=i) for i in range(3)]
    solo = [
        _engine(artifact).generate([p], q)[0].token_ids
        for p, q in zip(PROMPTS, params, strict=True)
    ]
    engine = AsyncEngine(_engine(artifact))

    async def one(i: int) -> list[int]:
        group = engine.submit([PROMPTS[i]], [params[i]])
        return _collect([output async for _, output in group])

    async def main():
        engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 60)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == solo
    with pytest.raises(EngineStoppedError):
        engine.submit([PROMPTS[0]], [params[0]])


def test_an_abort_from_another_thread_frees_the_blocks(chat_export):
    engine = AsyncEngine(_engine(chat_export[0]))
    blocks = engine.engine.block_manager

    async def main():
        engine.start()
        try:
            group = engine.submit([PROMPTS[0]], [SamplingParams(max_tokens=5000)])
            _, first = await asyncio.wait_for(anext(group), 30)
            assert not first.finished
            request_id = group.request_ids[0]
            threading.Thread(target=engine.abort, args=([request_id],)).start()
            outputs = [first] + [output async for _, output in group]
            last = outputs[-1]
            assert last.finished and last.outputs[0].finish_reason == "aborted"
            assert len(last.outputs[0].token_ids) < 5000
            for _ in range(100):  # the driver publishes after the iteration that aborted
                if engine.state.blocks_in_use == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.state.blocks_in_use == 0 and blocks.num_used_blocks() == 0
            # a closed stream aborts too
            group = engine.submit([PROMPTS[1]], [SamplingParams(max_tokens=5000)])
            await asyncio.wait_for(anext(group), 30)
            group.abort()
            for _ in range(100):
                if engine.state.blocks_in_use == 0 and not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert blocks.num_used_blocks() == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())

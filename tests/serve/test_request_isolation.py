"""One request can never fail another, through the real server and the ``openai`` client: a
request that goes wrong inside the engine's step (a sampling temperature that overflowed, a
NaN logits row) or reaches the length limit gets its own answer while a streaming request
batched with it completes; a length limit above the model's positions is refused at start."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="needs the dev extra (the openai client)")

from attnexport.errors import UserError  # noqa: E402
from attnexport.runtime import CacheConfig, Engine, OrtExecutor  # noqa: E402
from attnexport.runtime.text import Tokenizer  # noqa: E402
from attnexport.serve.served_model import ServedModel, load_served_model  # noqa: E402
from tests.runtime.poisoned import PoisonedRows  # noqa: E402
from tests.serve.conftest import KV_CACHE_BYTES  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402

VICTIM_TOKENS = 1500


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


class _Victim:
    """A streamed completion of ``VICTIM_TOKENS`` tokens, running once constructed: its first
    chunk is in, so a request sent now is batched with it."""

    def __init__(self, client: openai.OpenAI, prompt: str) -> None:
        self.stream = client.completions.create(
            model="export",
            prompt=prompt,
            max_tokens=VICTIM_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        self.chunks = [next(iter(self.stream))]

    def finish(self) -> tuple[list[int], str | None, int]:
        """(token ids, finish reason, completion tokens of the usage chunk)."""
        self.chunks += list(self.stream)
        ids, reason = [], None
        for chunk in self.chunks:
            for choice in chunk.choices:
                ids += choice.token_ids or []  # type: ignore[attr-defined]
                reason = choice.finish_reason or reason
        return ids, reason, self.chunks[-1].usage.completion_tokens


def test_a_temperature_below_the_epsilon_is_greedy_and_its_batch_completes(server):
    """temperature 1e-310 with top_p 0.9 made an IndexError that failed the engine step: the
    request and every request batched with it got a 500."""
    client = _client(server)
    prompt = "The capital of France is"
    greedy = client.completions.create(model="export", prompt=prompt, max_tokens=8)
    victim = _Victim(client, "Hello world, hello")
    for top_p in (0.9, 1.0):
        tiny = client.completions.create(
            model="export", prompt=prompt, max_tokens=8, temperature=1e-310, top_p=top_p
        )
        assert tiny.choices[0].text == greedy.choices[0].text
    ids, reason, completion_tokens = victim.finish()
    assert reason == "length" and len(ids) == completion_tokens == VICTIM_TOKENS


class _PoisonedOrt(PoisonedRows, OrtExecutor):
    pass


@pytest.fixture(scope="module")
def poisoned_server(chat_export):
    """A server whose executor returns a NaN logits row for the token ``executor.poison``
    (none until a test sets it): (base URL, executor)."""
    directory = chat_export[0]
    executor = _PoisonedOrt(directory / "model.onnx")
    engine = Engine(executor, CacheConfig(memory_bytes=KV_CACHE_BYTES))
    model = ServedModel("export", engine, Tokenizer.from_directory(directory))
    with running_server(model) as url:
        yield url, executor


def test_a_nan_logits_row_fails_its_request_alone_with_a_500(poisoned_server):
    url, executor = poisoned_server
    client = _client(url)
    prompt = "Hello world, hello"
    solo = _Victim(client, prompt).finish()[0]
    # A token neither the victim's prompt nor its output holds poisons the other request.
    ids = client.completions.create(
        model="export", prompt=prompt, max_tokens=1, extra_body={"return_token_ids": True}
    )
    victim_tokens = set(solo) | set(ids.prompt_token_ids[0])  # type: ignore[attr-defined]
    executor.poison = next(t for t in range(3, 400) if t not in victim_tokens)
    victim = _Victim(client, prompt)
    with pytest.raises(openai.InternalServerError, match="NonFiniteLogitsError"):
        client.completions.create(model="export", prompt=[5, executor.poison], max_tokens=4)
    ids, reason, _ = victim.finish()
    assert ids == solo and reason == "length"


def test_serving_a_max_model_len_above_the_models_positions_is_refused(chat_export):
    """It was served: the first request crossing the model's positions failed the
    executor's step, and every request batched with it got a 500."""
    with pytest.raises(UserError, match="max_model_len: 16385 is longer than the model's"):
        load_served_model(chat_export[0], max_model_len=16385, kv_cache_bytes=KV_CACHE_BYTES)


def test_requests_reaching_max_model_len_fail_or_end_alone(chat_export):
    """Under --max-model-len 512: a longer prompt is a 400 on admission, a request growing to
    the limit ends with "length", and the streaming request batched with them completes."""
    with running_server(chat_export[0], max_model_len=512, kv_cache_bytes=KV_CACHE_BYTES) as url:
        client = _client(url)
        victim = client.completions.create(
            model="export",
            prompt="Hello world, hello",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [next(iter(victim))]
        with pytest.raises(openai.BadRequestError, match="longer than the model's maximum"):
            client.completions.create(model="export", prompt=[5] * 513, max_tokens=4)
        crossing = client.completions.create(
            model="export",
            prompt=[5] * 500,
            max_tokens=100,
            extra_body={"ignore_eos": True},
        )
        assert crossing.choices[0].finish_reason == "length"
        assert crossing.usage.completion_tokens == 12
        chunks += list(victim)
        assert chunks[-1].choices[0].finish_reason == "length"

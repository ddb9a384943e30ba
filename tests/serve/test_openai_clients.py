"""The server driven by real clients: the official ``openai`` package (completions, chat,
streaming) and ``curl``; answers equal ``attnexport run`` on the same artifact; 64 concurrent
streaming clients each get exactly the tokens of their request run alone."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="needs the dev extra (the openai client)")

from attnexport.runtime import SamplingParams, engine_from_path  # noqa: E402
from tests.cli.helpers import run_json  # noqa: E402
from tests.serve.helpers import sse_events  # noqa: E402

PROMPTS = ["The capital of France is", "😀 naïve café", "Hello world, hello"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(server):
    (card,) = _client(server).models.list().data
    assert card.id == "export" and card.owned_by == "attnexport"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_completion_equals_attnexport_run(server, chat_export, capsys, prompt):
    (expected,) = run_json(capsys, chat_export[0], "--prompt", prompt, "--max-tokens", 12)
    completion = _client(server).completions.create(
        model="export", prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True}
    )
    (choice,) = completion.choices
    assert choice.text == expected["text"]
    assert choice.token_ids == expected["token_ids"]  # type: ignore[attr-defined]
    assert choice.finish_reason == expected["finish_reason"]
    assert completion.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert completion.usage.completion_tokens == len(expected["token_ids"])


def test_a_chat_completion_equals_attnexport_run_chat(server, chat_export, capsys):
    (expected,) = run_json(capsys, chat_export[0], "--chat", "Hi there", "--max-tokens", 10)
    chat = _client(server).chat.completions.create(
        model="export", messages=[{"role": "user", "content": "Hi there"}], max_tokens=10
    )
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert chat.usage.prompt_tokens == len(expected["prompt_token_ids"])


def test_streamed_chunks_concatenate_to_the_full_text(server):
    client = _client(server)
    for prompt in PROMPTS:
        full = client.completions.create(model="export", prompt=prompt, max_tokens=24)
        chunks = list(
            client.completions.create(model="export", prompt=prompt, max_tokens=24, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    messages = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="export", messages=messages, max_tokens=20)
    stream = client.chat.completions.create(
        model="export",
        messages=messages,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_samples_seed_and_stop(server):
    client = _client(server)
    params = {"model": "export", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0}
    first = client.completions.create(n=3, seed=5, **params)
    again = client.completions.create(n=3, seed=5, **params)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # three seeded streams, not one
    greedy = client.completions.create(model="export", prompt=PROMPTS[0], max_tokens=16)
    text = greedy.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model="export", prompt=PROMPTS[0], max_tokens=16, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="export", prompt=PROMPTS[0], max_tokens=16, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_stop_token_ids_and_token_id_prompts(server, chat_export):
    client = _client(server)
    ids = chat_export[1](PROMPTS[0])["input_ids"]
    base = client.completions.create(
        model="export", prompt=ids, max_tokens=12, extra_body={"return_token_ids": True}
    )
    tokens = base.choices[0].token_ids  # type: ignore[attr-defined]
    stop_id = tokens[4]
    cut = client.completions.create(
        model="export",
        prompt=ids,
        max_tokens=12,
        extra_body={"return_token_ids": True, "stop_token_ids": [stop_id]},
    )
    assert cut.choices[0].token_ids == tokens[: tokens.index(stop_id) + 1]  # type: ignore[attr-defined]
    assert cut.choices[0].finish_reason == "stop"
    both = client.completions.create(model="export", prompt=[ids, ids[:3]], max_tokens=4)
    assert [c.index for c in both.choices] == [0, 1]


def test_64_concurrent_streaming_clients_each_get_their_solo_tokens(server, chat_export):
    """Greedy: every client's streamed tokens equal its prompt run alone on a fresh engine."""
    artifact, tokenizer = chat_export
    words = [
        "The",
        "capital",
        "of",
        "France",
        "is",
        "Paris",
        "hello",
        "world",
        "naïve",
        "café",
        "tokenizers",
    ]
    prompts = [" ".join(words[i % 7 : i % 7 + 1 + i % 5]) + f" {i}" for i in range(64)]
    lengths = [4 + (i * 7) % 29 for i in range(64)]
    engine = engine_from_path(artifact)
    eos = tokenizer.eos_token_id
    solo = [
        engine.generate(
            [tokenizer(p)["input_ids"]], SamplingParams(max_tokens=n, stop_token_ids=(eos,))
        )[0].token_ids
        for p, n in zip(prompts, lengths, strict=True)
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> list[int]:
        stream = await client.completions.create(
            model="export",
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        tokens: list[int] = []
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids or []  # type: ignore[attr-defined]
        return tokens

    async def all_clients() -> list[list[int]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            jobs = [one(client, p, n) for p, n in zip(prompts, lengths, strict=True)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

    assert asyncio.run(all_clients()) == solo


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_completions_streaming_and_chat(server):
    def curl(route: str, body: dict) -> str:
        out = subprocess.run(
            ["curl", "-sS", "-N", "--max-time", "60", f"{server}{route}",
             "-H", "Content-Type: application/json", "-d", json.dumps(body)],
            capture_output=True, text=True, timeout=90, check=True,
        )  # fmt: skip
        return out.stdout

    body = {"model": "export", "prompt": PROMPTS[1], "max_tokens": 12}
    full = json.loads(curl("/v1/completions", body))
    events = list(sse_events(iter(curl("/v1/completions", {**body, "stream": True}).split("\n"))))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full["choices"][0]["text"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = json.loads(curl("/v1/chat/completions", {"messages": messages, "max_tokens": 8}))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["finish_reason"]
    error = json.loads(curl("/v1/completions", {"prompt": "x", "max_tokens": 0}))
    assert error["error"]["param"] == "max_tokens"

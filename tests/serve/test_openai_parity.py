"""What users of vLLM's and llama.cpp's OpenAI servers call, through the real ``openai``
client against ``attnexport serve`` on the real SmolLM2-135M-Instruct export (one server for
the module, with a chat template that renders tools, Qwen 2.5's hermes format):
log-probabilities (completions, echo, chat, streams, vLLM's prompt_logprobs) equal
transformers' float32 log_softmax; penalties and biases give the tokens of a reference of
vLLM's definitions; JSON answers validate against their schemas; tool calls parse and their
arguments validate; /tokenize and /detokenize round-trip; lm-eval's local-completions model
scores as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from attnexport.runtime.sampling import SamplingParams  # noqa: E402
from attnexport.tolerances import model_tolerance  # noqa: E402
from tests.runtime.test_logits_processing import vllm_reference  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402

MODEL = "smollm2"
TOLERANCE = model_tolerance(torch.float32)
HERMES_TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
TEXT = "The Amazon rainforest covers much of the Amazon basin of South America."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def url(smollm2_fp32_artifact):
    with running_server(
        smollm2_fp32_artifact,
        name=MODEL,
        max_model_len=1024,
        kv_cache_bytes=128 << 20,
        chat_template=HERMES_TEMPLATE.read_text(),
        num_threads=2,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint))


@pytest.fixture(scope="module")
def hf_model(smollm2_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _chat_ids(tokenizer, content: str) -> list[int]:
    """The prompt the server makes of one user message (its chat template is the file's)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        return_dict=False,
        chat_template=HERMES_TEMPLATE.read_text(),
    )


# ---------------------------------------------------------------------- log-probabilities
def test_completion_logprobs_with_echo_equal_transformers(client, tokenizer, hf_model):
    prompt = tokenizer.encode(TEXT)
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=3,
        logprobs=3,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    ids = prompt + choice.model_extra["token_ids"]
    rows = _log_softmax(hf_model, ids)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(ids) and choice.text.startswith(TEXT)
    for position in range(1, len(ids)):
        row = rows[position - 1]
        assert abs(logprobs.token_logprobs[position] - float(row[ids[position]])) <= TOLERANCE
        top = logprobs.top_logprobs[position]
        best = torch.topk(row, 3)
        for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert abs(top[tokenizer.decode([token])] - value) <= TOLERANCE
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_streamed_or_not_equal_transformers(client, tokenizer, hf_model):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=4
    )
    entries = whole.choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=4, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    ids = _chat_ids(tokenizer, messages[0]["content"])
    generated = tokenizer.encode(whole.choices[0].message.content, add_special_tokens=False)
    rows = _log_softmax(hf_model, ids + generated)[len(ids) - 1 :]
    for row, entry in zip(rows, entries, strict=False):
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].token == entry.token
        assert abs(entry.logprob - float(row.max())) <= TOLERANCE  # greedy: the top token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_vllm_prompt_logprobs(client, tokenizer, hf_model):
    prompt = tokenizer.encode(TEXT)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    scores = response.choices[0].model_extra["prompt_logprobs"]
    rows = _log_softmax(hf_model, prompt)
    assert scores[0] is None and len(scores) == len(prompt)
    for position in range(1, len(prompt)):
        entry = scores[position][str(prompt[position])]
        assert abs(entry["logprob"] - float(rows[position - 1, prompt[position]])) <= TOLERANCE
        assert entry["decoded_token"] == tokenizer.decode([prompt[position]])
        ranks = sorted(v["rank"] for v in scores[position].values())
        assert ranks[:2] == [1, 2]  # the token and its row's two most likely


# ---------------------------------------------------------------------- penalties
def test_penalties_and_bias_give_the_tokens_of_vllms_definitions(client, tokenizer, hf_model):
    content = "Write the word 'hello' five times."
    ids = _chat_ids(tokenizer, content)
    params = SamplingParams(
        max_tokens=10,
        repetition_penalty=1.3,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        logit_bias={tokenizer.encode("Hello")[0]: -100.0, 28: 3.0},
        min_tokens=4,
        stop_token_ids=(tokenizer.eos_token_id,),
    )
    expected: list[int] = []
    step = torch.tensor([ids])
    cache = None
    for _ in range(params.max_tokens):
        with torch.no_grad():
            out = hf_model(step, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1:].float().numpy()
        processed = vllm_reference(logits, [np.array(ids)], [expected], [params])
        token = int(processed[0].argmax())
        expected.append(token)
        if token == tokenizer.eos_token_id:
            break
        step = torch.tensor([[token]])
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=params.max_tokens,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias={str(k): v for k, v in params.logit_bias.items()},
        extra_body={
            "repetition_penalty": params.repetition_penalty,
            "min_tokens": params.min_tokens,
            "return_token_ids": True,
        },
    )
    assert response.choices[0].model_extra["token_ids"] == expected


# ---------------------------------------------------------------------- structured output
PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "coastal"]}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "capital", "tags"],
}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(client, stream):
    format_ = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": PLACE, "strict": True},
    }
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Lisbon as JSON."}],
        max_tokens=120,
        response_format=format_,
        temperature=0.8,
        seed=3,
        n=1 if stream else 2,
    )
    if stream:
        texts = [""]
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        response = client.chat.completions.create(**request)
        assert {c.finish_reason for c in response.choices} == {"stop"}
        texts = [c.message.content for c in response.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PLACE)


def test_json_object_answers_are_objects(client):
    response = client.completions.create(
        model=MODEL,
        prompt="A JSON description of a cat:",
        max_tokens=80,
        extra_body={"response_format": {"type": "json_object"}, "logprobs": 1},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.text), dict)


def test_a_bad_schema_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad
        )


# ---------------------------------------------------------------------- tools
def _check_call(call, tools) -> None:
    tool = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_parse_and_validate(client, choice):
    tools = [WEATHER, TIME]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=80,
    )
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    _check_call(message.tool_calls[0], tools)
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "get_time"


def test_streamed_tool_calls_and_auto_mode(client):
    tools = [WEATHER]
    calls, reasons = [], []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo in celsius?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        stream=True,
    ):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert len(calls) == 1 and reasons[-1] == "tool_calls"
    _check_call(calls[0], tools)
    # auto: the model may answer in words; whatever it does, the response is consistent.
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        max_tokens=60,
    )
    message = response.choices[0].message
    if message.tool_calls:
        assert response.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert "<tool_call>" not in (message.content or "")


def test_a_tool_turn_goes_back_through_the_template(client, url):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
    ]
    rendered = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [WEATHER]})
    text = httpx.post(f"{url}/detokenize", json={"tokens": rendered.json()["tokens"]}).json()
    assert '"city": "Oslo"' in text["prompt"] and "4 degrees, rain" in text["prompt"]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8
    )
    assert response.choices[0].message.content


# ---------------------------------------------------------------------- tokenize, models
def test_tokenize_detokenize_round_trip_and_models(client, url, tokenizer):
    text = "Héllo, wörld! 🌍 tokens"
    tokenized = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True})
    body = tokenized.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and len(body["token_strs"]) == body["count"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json()["tokens"] == _chat_ids(tokenizer, "Hi")
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


# ---------------------------------------------------------------------- lm-eval
def test_lm_eval_local_completions_scores_as_transformers(
    url, smollm2_checkpoint, tokenizer, hf_model
):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=MODEL,
        tokenizer=str(smollm2_checkpoint),
        tokenizer_backend="huggingface",
        num_concurrent=1,
        max_retries=1,
        batch_size=2,
    )
    pairs = [
        ("The capital of France is", " Paris"),
        ("The Amazon rainforest covers much of the Amazon", " basin of South America."),
        ("Two plus two equals", " seven"),
    ]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (score, greedy) in zip(pairs, results, strict=True):
        context_ids = tokenizer.encode(context)
        whole = tokenizer.encode(context + continuation)
        rows = _log_softmax(hf_model, whole)
        expected = sum(float(rows[j - 1, whole[j]]) for j in range(len(context_ids), len(whole)))
        assert abs(score - expected) <= TOLERANCE * len(whole)
        expected_greedy = all(
            int(rows[j - 1].argmax()) == whole[j] for j in range(len(context_ids), len(whole))
        )
        assert greedy == expected_greedy

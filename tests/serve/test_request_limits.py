"""What one request may cost the server, and what it may ask: a body past
``--max-request-bytes`` is a 413 (declared or chunked); parsing and the chat template run off
the event loop, so a template working to its CPU limit never stalls other clients; fields the
server does not do, another model's name, stop ids outside the vocabulary, lone surrogates and
more prompts than the queue holds are 4xx errors naming the field, never a 500 or a silent
default."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
httpx = pytest.importorskip("httpx", reason="needs the dev extra (httpx)")
openai = pytest.importorskip("openai", reason="needs the dev extra (the openai client)")

from attnexport.errors import UserError  # noqa: E402
from attnexport.serve.app import create_app  # noqa: E402
from attnexport.serve.served_model import load_served_model  # noqa: E402
from tests.serve.conftest import KV_CACHE_BYTES  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402
from tests.text_tokenizers import CHAT_TEMPLATE  # noqa: E402

MAX_REQUEST_BYTES = 256 << 10
TEMPLATE_SECONDS = 2.0
MAX_QUEUED = 8
# The test tokenizer's template, which works without end for one message: the audit's two
# nested range(10000) loops (seconds of CPU), or a 10 GB string.
TRIGGERED = (
    "{% if messages[0]['content'] == 'spin' %}{% for i in range(10000) %}"
    "{% for j in range(10000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[0]['content'] == 'balloon' %}{{ 'x' * 10000000000 }}{% endif %}" + CHAT_TEMPLATE
)


def with_template(artifact, out, template: str):
    """A copy of ``artifact`` whose tokenizer has ``template``."""
    shutil.copytree(artifact, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def limited(chat_export, tmp_path_factory):
    artifact = with_template(chat_export[0], tmp_path_factory.mktemp("t") / "export", TRIGGERED)
    options = {
        "kv_cache_bytes": KV_CACHE_BYTES,
        "max_request_bytes": MAX_REQUEST_BYTES,
        "chat_template_seconds": TEMPLATE_SECONDS,
        "max_queued_requests": MAX_QUEUED,
    }
    with running_server(artifact, **options) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error


def _post(url: str, route: str, body, **options) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=120, **options)


def _post_raw(url: str, route: str, content: bytes | str) -> httpx.Response:
    """``content`` sent as it is, labelled JSON (bodies json= cannot write)."""
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}{route}", content=content, headers=headers, timeout=60)


# ---------------------------------------------------------------------- the body's size
def test_a_body_past_the_limit_is_a_413_before_it_is_read(limited):
    body = json.dumps({"model": "export", "prompt": [5] * MAX_REQUEST_BYTES}).encode()
    response = _post_raw(limited, "/v1/completions", body)
    error = _error(response, 413)
    assert error["code"] == "request_too_large" and str(MAX_REQUEST_BYTES) in error["message"]


def test_a_chunked_body_past_the_limit_is_a_413(limited):
    def chunks():
        yield b'{"model": "export", "prompt": [5'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 8):
            yield b", 5" * 341
        yield b"]}"

    response = httpx.post(f"{limited}/v1/completions", content=chunks(), timeout=60)
    assert "content-length" not in response.request.headers  # it really was chunked
    assert _error(response, 413)["code"] == "request_too_large"


def test_a_body_at_the_limit_is_read(limited):
    body = {"model": "export", "prompt": "Hello", "max_tokens": 1, "user": ""}
    padding = MAX_REQUEST_BYTES - len(json.dumps(body).encode())
    body["user"] = "u" * padding
    content = json.dumps(body).encode()
    assert len(content) == MAX_REQUEST_BYTES
    response = _post_raw(limited, "/v1/completions", content)
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------- the chat template
def test_a_template_at_its_cpu_limit_never_stalls_other_clients(limited):
    """The audit's nested loops rendered on the event loop and froze every client for 12 s.
    While the heavy request renders (up to its limit), small requests keep completing, each
    far faster than the heavy one takes."""
    heavy: dict = {}

    def render():
        start = time.perf_counter()
        messages = [{"role": "user", "content": "spin"}]
        try:
            heavy["response"] = _post(limited, "/v1/chat/completions", {"messages": messages})
        except httpx.HTTPError as error:  # (unbounded, it outlasts the client's timeout)
            heavy["response"] = error
        heavy["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=render)
    thread.start()
    time.sleep(0.5)  # it is rendering
    latencies = []
    small = {"model": "export", "prompt": "Hi", "max_tokens": 2}
    while thread.is_alive() and len(latencies) < 200:
        start = time.perf_counter()
        assert _post(limited, "/v1/completions", small).status_code == 200
        latencies.append(time.perf_counter() - start)
    thread.join(180)
    assert len(latencies) >= 3, (latencies, heavy["seconds"])
    assert max(latencies) < heavy["seconds"] / 3, (latencies, heavy["seconds"])
    error = _error(heavy["response"], 400)
    assert error["param"] == "messages" and "CPU time" in error["message"], error


def test_a_template_that_would_allocate_without_end_is_a_400(limited):
    messages = [{"role": "user", "content": "balloon"}]
    error = _error(_post(limited, "/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"] == "messages" and "characters" in error["message"], error
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    ok = _post(limited, "/v1/chat/completions", body)
    assert ok.status_code == 200, ok.text


def test_a_template_that_does_not_compile_is_refused_at_start_up(chat_export, tmp_path):
    artifact = with_template(chat_export[0], tmp_path / "export", "{% for m in messages %}")
    with pytest.raises(UserError, match="does not compile"):
        load_served_model(artifact, kv_cache_bytes=KV_CACHE_BYTES)


def test_a_template_that_cannot_render_one_message_is_refused_at_start_up(chat_export, tmp_path):
    spin = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
    artifact = with_template(chat_export[0], tmp_path / "export", spin + CHAT_TEMPLATE)
    model = load_served_model(artifact, kv_cache_bytes=KV_CACHE_BYTES)
    with pytest.raises(UserError, match="cannot render a one-message conversation"):
        create_app(model, chat_template_seconds=0.2)


# ---------------------------------------------------------------------- fields
@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("min_p", 0.1),
        ("best_of", 2),
        ("suffix", "and then"),
        ("max_token", 4),  # a typo is refused too, not ignored
    ],
)
def test_a_field_the_server_does_not_do_is_a_400_naming_it(limited, field, value):
    body = {"model": "export", "prompt": "Hi", "max_tokens": 2, field: value}
    error = _error(_post(limited, "/v1/completions", body), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error


def test_neutral_values_of_unsupported_fields_are_accepted(limited):
    chat = _client(limited).chat.completions.create(
        model="export",
        messages=[{"role": "user", "content": "Hi", "name": None}],
        max_tokens=2,
        logprobs=False,
        tools=[],
        presence_penalty=0,
        response_format={"type": "text"},
        extra_body={"min_p": 0, "functions": [], "service_tier": "auto"},
    )
    assert chat.usage.completion_tokens == 2


def test_a_chat_message_field_the_server_does_not_do_is_a_400(limited):
    messages = [{"role": "user", "content": "Hi", "refusal": "no"}]
    error = _error(_post(limited, "/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"] == "messages" and "messages.0.refusal" in error["message"], error


def test_another_model_s_name_is_openai_s_404(limited):
    with pytest.raises(openai.NotFoundError) as caught:
        _client(limited).completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"], error
    assert "export" in error["message"]  # the model it does serve


# ---------------------------------------------------------------------- values
def test_stop_token_ids_outside_the_vocabulary_are_a_400(limited):
    body = {"model": "export", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [3, 10**6]}
    error = _error(_post(limited, "/v1/completions", body), 400)
    assert error["param"] == "stop_token_ids" and "vocabulary" in error["message"], error


def test_stop_token_ids_and_stop_strings_are_capped(limited):
    body = {"model": "export", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [3] * 1025}
    assert _error(_post(limited, "/v1/completions", body), 400)["param"] == "stop_token_ids"
    body = {"model": "export", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [3] * 1024}
    assert _post(limited, "/v1/completions", body).status_code == 200
    for stop in (["a"] * 17, ["a" * 1025]):
        body = {"model": "export", "prompt": "Hi", "max_tokens": 2, "stop": stop}
        assert _error(_post(limited, "/v1/completions", body), 400)["param"] == "stop"


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400(limited, route, body, param):
    response = _post_raw(limited, route, body)
    error = _error(response, 400)
    assert error["param"] == param and "surrogate" in error["message"], error


@pytest.mark.parametrize("prompt", [[5, 6], "Hi"])
def test_more_prompts_than_the_queue_holds_is_a_400_not_a_503_forever(limited, prompt):
    body = {"model": "export", "prompt": [prompt] * (MAX_QUEUED + 1), "max_tokens": 1}
    error = _error(_post(limited, "/v1/completions", body), 400)
    assert error["param"] == "prompt" and "--max-queued-requests" in error["message"], error
    body["prompt"] = [prompt] * MAX_QUEUED
    assert _post(limited, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("content", [b'{"prompt": "Hi",, }', b'{"prompt": [1, 2', b"\xff\xfe{"])
def test_malformed_json_is_a_400_with_no_param(limited, content):
    response = _post_raw(limited, "/v1/completions", content)
    error = _error(response, 400)
    assert error["param"] is None and "not valid JSON" in error["message"], error

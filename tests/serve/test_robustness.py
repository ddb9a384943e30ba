"""What a server must survive: clients that go away (their blocks come back), bad payloads
(a 400 with an OpenAI error body, fuzzed), a full queue (503), and SIGTERM (running streams
finish, new connections are refused, the process exits 0)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
httpx = pytest.importorskip("httpx", reason="needs the dev extra (httpx)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.serve.conftest import KV_CACHE_BYTES  # noqa: E402
from tests.serve.helpers import metric, running_server, sse_events, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LONG = {
    "model": "export",
    "prompt": "The capital of France is",
    "max_tokens": 16000,
    "ignore_eos": True,
}


def _blocks(url: str) -> float:
    return metric(url, "attnexport_kv_blocks_in_use")


def _aborted(url: str) -> float:
    return metric(url, "attnexport_requests_finished_total", finish_reason="aborted")


def test_a_cancelled_stream_returns_every_block(server):
    aborted = _aborted(server)
    body = {**LONG, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = sse_events(response.iter_lines())  # kept: closing it closes the response
        assert next(events)["choices"][0]["text"] is not None
        assert _blocks(server) > 0  # 16000 tokens to go: it is running
    wait_for(lambda: _blocks(server) == 0, what="the cancelled stream's blocks")
    wait_for(lambda: _aborted(server) == aborted + 1, what="the abort")


def test_a_client_that_leaves_a_plain_request_returns_every_block(server):
    aborted = _aborted(server)
    body = json.dumps(LONG).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: _blocks(server) > 0, what="the request to start")
    wait_for(lambda: _blocks(server) == 0, what="the abandoned request's blocks")
    wait_for(lambda: _aborted(server) == aborted + 1, what="the abort")


def _assert_openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]
    return error


BAD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=-1),
    st.floats(allow_nan=True, allow_infinity=False).filter(lambda f: not f >= 0),
    st.text(max_size=5),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
# Each field with values it must refuse (besides BAD_VALUES of the wrong type).
FIELDS = {
    "prompt": st.sampled_from([[], [-1], [10**9], [[1], "a"], [[]], True, 1.5, {"a": 1}, None]),
    "max_tokens": st.one_of(st.just(0), st.just(-3), st.just(1.5), st.just("8")),
    "temperature": st.one_of(st.just(-0.1), st.just("0")),
    "top_p": st.one_of(st.just(0.0), st.just(1.5), st.just(-1.0)),
    "top_k": st.one_of(st.just(-2), st.just(0.5)),
    "n": st.one_of(st.just(0), st.just(10**6), st.just(2.0)),
    "seed": st.one_of(st.just(-1), st.just(1.5), st.just("1")),
    "stop": st.one_of(st.just(3), st.just([1, 2])),
    "stop_token_ids": st.one_of(st.just([-1]), st.just(["a"]), st.just(7)),
    "stream": st.one_of(st.just("yes"), st.just(2)),
    "logprobs": st.sampled_from([21, -1, True, "1"]),
}
# Fields whose values of any other JSON type are refused too; each with what it accepts.
VALID = {
    "max_tokens": lambda v: type(v) is int and v >= 1,
    "temperature": lambda v: type(v) in (int, float) and v >= 0,
    "top_p": lambda v: type(v) in (int, float) and 0 < v <= 1,
    "n": lambda v: type(v) is int and v >= 1,
    "stop_token_ids": lambda v: isinstance(v, list) and all(type(t) is int and t >= 0 for t in v),
    "stream": lambda v: type(v) is bool,
}
WRONG_TYPE = {"max_tokens", "temperature", "top_p", "n", "stop_token_ids", "stream"}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_bad_completion_payloads_get_a_400_naming_the_field(server, data):
    field = data.draw(st.sampled_from(sorted(FIELDS)))
    strategy = FIELDS[field]
    if field in WRONG_TYPE:
        valid = VALID[field]
        strategy = st.one_of(strategy, BAD_VALUES.filter(lambda v: v is not None and not valid(v)))
    value = data.draw(strategy)
    body = {"model": "export", "prompt": "Hello", "max_tokens": 2, field: value}
    content = json.dumps(body)  # NaN too, which Python's JSON reader (the server's) accepts
    response = httpx.post(
        f"{server}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    error = _assert_openai_error(response)
    assert error["param"] == field, (body, error)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.one_of(
        st.binary(max_size=40),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=8,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_garbage_bodies_get_a_400(server, body, route):
    response = httpx.post(
        f"{server}{route}", content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    _assert_openai_error(response)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_bad_chat_payloads_get_a_400(server, body, param):
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert _assert_openai_error(response)["param"] == param


def test_unknown_routes_and_methods_get_openai_errors(server):
    _assert_openai_error(httpx.get(f"{server}/v1/nothing", timeout=10), 404)
    _assert_openai_error(httpx.get(f"{server}/v1/completions", timeout=10), 405)


def test_a_full_queue_answers_503_and_recovers(chat_export):
    options = {"max_num_seqs": 1, "max_queued_requests": 1, "kv_cache_bytes": KV_CACHE_BYTES}
    with (
        running_server(chat_export[0], **options) as url,
        httpx.Client(timeout=30) as client,
    ):
        streaming = {**LONG, "stream": True}
        with client.stream("POST", f"{url}/v1/completions", json=streaming) as running:
            events = sse_events(running.iter_lines())
            next(events)  # it holds the only slot
            with client.stream("POST", f"{url}/v1/completions", json=streaming) as queued:
                assert queued.status_code == 200
                wait_for(lambda: metric(url, "attnexport_requests_waiting") == 1)
                refused = client.post(f"{url}/v1/completions", json=LONG)
                error = _assert_openai_error(refused, 503)
                assert "max-queued-requests" in error["message"]
                assert refused.headers["Retry-After"] == "1"
                assert metric(url, "attnexport_requests_rejected_total", status="503") == 1
        wait_for(lambda: _blocks(url) == 0, what="both streams' blocks")
        ok = client.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _serve_process(export_dir: Path, shutdown_timeout: float):
    """``attnexport serve`` of ``export_dir`` as a child process on a free port, once healthy:
    yields ``(process, url)``; kills the process if it still runs when the block ends (its
    stderr stays readable)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "attnexport.cli.main", "serve", str(export_dir)]
    command += ["--port", str(port), "--shutdown-timeout", str(shutdown_timeout)]
    command += ["--log-level", "warning", "--kv-cache-memory", str(KV_CACHE_BYTES / 2**30)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _healthy(url), timeout=60, what="the server to start")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_sigterm_finishes_running_streams_then_stops(chat_export):
    with _serve_process(chat_export[0], shutdown_timeout=30) as (process, url):
        body = {**LONG, "max_tokens": 1500, "stream": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as response,
        ):
            events = sse_events(response.iter_lines())
            first = next(events)
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: not _healthy(url), what="the listener to close")
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [first, *rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the SIGTERM it handled once it has shut down (older ones exit 0)
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    stderr = process.stderr.read().decode()
    assert "Traceback" not in stderr, stderr


def test_requests_past_the_shutdown_timeout_get_an_answer(chat_export):
    """uvicorn cancels what outlives its graceful shutdown: a plain request got a text/plain
    500 and a stream was cut with neither an error event nor [DONE]. They are aborted in the
    engine first: an OpenAI-shaped 503, and an error event then [DONE]."""
    plain: dict = {}
    with _serve_process(chat_export[0], shutdown_timeout=0.5) as (process, url):

        def post() -> None:
            plain["response"] = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120)

        thread = threading.Thread(target=post)
        thread.start()
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as stream,
        ):
            events = sse_events(stream.iter_lines())
            next(events)
            wait_for(lambda: metric(url, "attnexport_requests_running") == 2, what="both")
            process.send_signal(signal.SIGTERM)
            rest = list(events)
        thread.join(120)
        assert rest[-1] == "[DONE]", rest[-3:]
        error = rest[-2]["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        response = plain["response"]
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "service_unavailable"
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    stderr = process.stderr.read().decode()
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False

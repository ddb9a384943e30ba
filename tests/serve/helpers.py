"""Helpers of the server tests: the exported model, an in-process uvicorn server on a free
loopback port (every wait bounded), and readers of /metrics and server-sent events."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from attnexport.cli.main import main
from attnexport.serve.app import create_app
from attnexport.serve.http_server import DrainingServer
from attnexport.serve.served_model import ServedModel, load_served_model

START_TIMEOUT = 60.0
APP_OPTIONS = ("max_queued_requests", "max_request_bytes", "chat_template_seconds")


def export_chat_llama(path: Path, max_positions: int = 1024):
    from transformers import AutoTokenizer

    from tests.models.hf_reference import tiny_llama
    from tests.text_tokenizers import byte_level_bpe

    checkpoint = path / "checkpoint"
    byte_level_bpe(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    tiny_llama(
        checkpoint,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    out = path / "export"
    assert main(["export", str(checkpoint), "--out", str(out)]) == 0
    return out, tokenizer


@contextlib.contextmanager
def running_server(artifact: Path | ServedModel, **options) -> Iterator[str]:
    """Serves ``artifact`` (an export, or a model already loaded) as ``attnexport serve`` does
    (uvicorn, draining at shutdown) in a thread of this process on a free port; yields its base
    URL and stops it (graceful shutdown) on exit. ``options``: ``load_served_model`` keywords
    and the ``create_app`` keywords ``max_queued_requests``, ``max_request_bytes``,
    ``chat_template_seconds``."""
    app_options = {key: options.pop(key) for key in APP_OPTIONS if key in options}
    if not isinstance(artifact, ServedModel):
        artifact = load_served_model(artifact, **options)
    app = create_app(artifact, **app_options)
    with running_app(app) as url:
        yield url


@contextlib.contextmanager
def running_app(app) -> Iterator[str]:
    """Serves the ASGI ``app`` (draining at shutdown) in a thread of this process on a free
    port; yields its base URL and stops it (graceful shutdown) on exit."""
    server = DrainingServer(app, shutdown_timeout=10, host="127.0.0.1", port=0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the test server did not stop"


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of ``GET /metrics`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def wait_for(condition, timeout: float = 20.0, what: str = "condition") -> None:
    """Polls ``condition()`` until it is true; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """The ``data:`` payloads of a server-sent event stream: dicts, and ``"[DONE]"``."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", line
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)

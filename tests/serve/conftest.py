"""Fixtures of the server tests: a tiny Llama checkpoint with a real byte-level BPE tokenizer
and a chat template, exported once per session, and a server over it on a loopback port. The
test modules skip without the serve extra (each calls ``pytest.importorskip`` first)."""

from __future__ import annotations

import pytest

KV_CACHE_BYTES = 64 << 20
"""The test servers' KV pool: 32768 blocks of this model, 512K tokens."""


@pytest.fixture(scope="session")
def chat_export(tmp_path_factory):
    """(export directory, transformers tokenizer): a 1-layer Llama over a 400-token BPE with a
    chat template and EOS ``</s>``, 16384 positions: a request of 16000 tokens runs for a
    second or more (a step takes ~0.1 ms), so a test can leave it while it surely runs."""
    from tests.serve.helpers import export_chat_llama

    return export_chat_llama(tmp_path_factory.mktemp("serve_chat_llama"), max_positions=16384)


@pytest.fixture(scope="module")
def server(chat_export):
    """A server over ``chat_export`` in this process (uvicorn in a thread): its base URL."""
    from tests.serve.helpers import running_server

    with running_server(chat_export[0], kv_cache_bytes=KV_CACHE_BYTES) as url:
        yield url

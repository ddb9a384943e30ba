"""The server runs an ONNX artifact in a process where torch cannot be imported (a deploy
install without torch): ``attnexport serve --help`` (the CLI's parser), the serve layer and a
request through the app load neither torch, the ops layer nor the lowering."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("httpx", reason="needs the dev extra (httpx, for the test client)")

from tests.runtime.test_torch_free_core import FORBIDDEN, _loaded

CODE = """
import json, sys
sys.modules["torch"] = None
from fastapi.testclient import TestClient
from attnexport.cli.main import main
try:
    main(["serve", "--help"])
except SystemExit as exit:
    assert exit.code == 0, exit.code
from attnexport.serve.app import create_app
from attnexport.serve.served_model import load_served_model
with TestClient(create_app(load_served_model(ARTIFACT, kv_cache_bytes=4 << 20))) as client:
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
print(json.dumps([response.status_code, response.json()["usage"], LOADED]))
"""


def test_serving_an_onnx_artifact_needs_no_torch(chat_export):
    code = CODE.replace("ARTIFACT", repr(str(chat_export[0]))).replace("LOADED", _loaded(FORBIDDEN))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    status, usage, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == 200 and usage["completion_tokens"] == 4
    assert loaded == []

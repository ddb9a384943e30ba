"""``attnexport serve``'s bad flags and artifacts are one-line errors (exit 2) before anything
binds a port."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")

from tests.cli.helpers import assert_one_line_error, run_cli


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-queued-requests", "-1"], "--max-queued-requests"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory"),
    ],
)
def test_bad_flags_exit_2(capsys, chat_export, flags, needle):
    code, _, err = run_cli(capsys, "serve", chat_export[0], *flags)
    assert code == 2
    assert_one_line_error(err, "serve", needle)


def test_a_missing_artifact_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", tmp_path / "nothing")
    assert code == 2
    assert_one_line_error(err, "serve", "ARTIFACT", "does not exist")

"""Helpers of the CLI tests: ``attnexport`` run in-process and its one-line errors."""

from __future__ import annotations

import json

import torch

from attnexport.cli.main import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``attnexport ARGV`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv) -> list[dict]:
    """The ``outputs`` of ``attnexport run ARGV --json``, which must exit 0."""
    capsys.readouterr()
    code, out, err = run_cli(capsys, "run", *argv, "--json")
    assert code == 0, err
    return json.loads(out)["outputs"]


def assert_one_line_error(err: str, command: str, *needles: str) -> None:
    """``err`` is one line, ``attnexport COMMAND: error: ...``, holding every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"attnexport {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate``: the new tokens only."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def stop_before_serving(monkeypatch) -> None:
    """``attnexport serve`` in this process stops (exit code 130, as on Ctrl-C) where it would
    build its app: what it refuses or prints before serving can be tested without a server."""
    import attnexport.serve.app

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(attnexport.serve.app, "create_app", interrupted)

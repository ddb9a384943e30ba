"""benchmarks/peers.py and the real model's peer legs (benchmarks/generate_smollm2.py): a peer
that cannot install is skipped with its reason, in the legs and in the table, and never
retried on every run. Nothing is installed here: the peers' environments live in a temporary
``$ATTNEXPORT_PEERS``."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNEXPORT_PEERS", str(tmp_path / "peers"))
    return load_benchmark("peers")


def _record_failure(peers, name: str, reason: str) -> None:
    """The state make_venv leaves after an install that failed."""
    directory = peers.venv_dir(name)
    directory.mkdir(parents=True)
    state = {"recipe": peers._recipe(peers.get_peer(name)), "failed": reason}
    (directory / ".attnexport-peer.json").write_text(json.dumps(state))


def _no_subprocess(monkeypatch, peers):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(peers.subprocess, "run", refuse)


def test_a_missing_environment_is_named(peers):
    for name in peers.PEERS:
        assert "no environment yet" in peers.unavailable_reason(name)


def test_a_failed_install_is_remembered_not_retried(peers, monkeypatch):
    _record_failure(peers, "vllm", "vLLM CPU cannot install here: no wheel")
    _no_subprocess(monkeypatch, peers)
    assert peers.unavailable_reason("vllm") == "vLLM CPU cannot install here: no wheel"
    with pytest.raises(peers.PeerUnavailable, match="no wheel"):
        peers.make_venv("vllm")
    with pytest.raises(peers.PeerUnavailable, match="no wheel"):
        peers.run_leg("vllm", "fp32", Path("ckpt"), {"prompts": [[5]], "new_tokens": 2})


def test_a_changed_recipe_makes_the_environment_again(peers, monkeypatch):
    _record_failure(peers, "genai", "old failure")
    state = peers.venv_dir("genai") / ".attnexport-peer.json"
    state.write_text(json.dumps({"recipe": "an older recipe", "failed": "old failure"}))
    assert "no environment yet" in peers.unavailable_reason("genai")
    calls = []

    def fail_to_make(command, *args, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="no ensurepip")

    monkeypatch.setattr(peers.subprocess, "run", fail_to_make)
    with pytest.raises(peers.PeerUnavailable, match="python -m venv failed"):
        peers.make_venv("genai", log=lambda line: None)
    assert [c[1:3] for c in calls] == [["-m", "venv"]]
    assert "python -m venv failed" in peers.unavailable_reason("genai")


def test_unknown_peer_and_format_are_named(peers):
    with pytest.raises(ValueError, match="unknown peer 'tgi'"):
        peers.get_peer("tgi")
    with pytest.raises(ValueError, match="no format 'q2_k'"):
        peers.model_path("llamacpp", "q2_k", Path("ckpt"))


def test_peer_legs_skip_cleanly_in_the_benchmark(peers, monkeypatch, tmp_path):
    """Every peer absent: each of their legs is skipped with the peer's reason, no process
    runs, and the table says why in the leg's row."""
    bench = load_benchmark("generate_smollm2")
    monkeypatch.setattr(bench, "_module", lambda name: peers if name == "peers" else None)
    for name in peers.PEERS:
        _record_failure(peers, name, f"{name} cannot install here: test")
    _no_subprocess(monkeypatch, peers)
    args = argparse.Namespace(
        ours=[], peers=list(peers.PEERS), classes=list(bench.CLASSES), threads=2, work=tmp_path
    )
    legs = bench.plan_legs(args, tmp_path / "ckpt", log=lambda line: None)
    assert {leg.peer for leg in legs} == set(peers.PEERS)
    assert len(legs) == sum(len(p.formats) for p in peers.PEERS.values())
    results = {leg.name: {"128x1": [bench.run_leg(args, leg, 1, 128)]} for leg in legs}
    for leg in legs:
        assert results[leg.name]["128x1"] == [{"skipped": f"{leg.peer} cannot install here: test"}]
    table = "\n".join(bench.tables(legs, results, [1], [128]))
    assert table.count("cannot install here: test") == len(legs)


def test_the_ratio_is_against_the_best_peer_of_the_class(peers):
    bench = load_benchmark("generate_smollm2")
    legs = [
        bench.Leg("ours int8", "8-bit", None, "int8"),
        bench.Leg("llama.cpp q8_0", "8-bit", "llamacpp", "q8_0"),
        bench.Leg("OpenVINO int8", "8-bit", "openvino", "int8"),
        bench.Leg("llama.cpp f32", "fp32", "llamacpp", "f32"),
    ]

    def runs(*rates):
        return {"128x8": [{"decode_tok_s": r, "ttft_s": 10 / r, "peak_rss_mb": 1} for r in rates]}

    results = {
        "ours int8": runs(100, 120, 110),  # median 110
        "llama.cpp q8_0": runs(50, 90, 60),  # median 60
        "OpenVINO int8": runs(100, 80, 200),  # median 100: the best 8-bit peer
        "llama.cpp f32": runs(1000),  # another class: not compared
    }
    (row,) = [
        line
        for line in bench.ratio_lines(legs, results, [8], [128])
        if line.startswith("| ours int8")
    ]
    # TTFT against the fastest peer's median TTFT (0.1 s)
    assert "1.10x OpenVINO int8 / TTFT 0.91x" in row


def test_a_quantized_gguf_before_its_f32_one_never_waits_on_itself(peers, monkeypatch, tmp_path):
    """llama.cpp's Q8_0 is quantized from the F32 GGUF, which model_path makes first when it is
    not cached: both conversions ran under one per-peer lock and the process waited on itself
    forever. The converter's commands are stood in for (no llama.cpp here): each writes its
    output file, and the view it converts from reads as transformers 4 expects."""
    import threading

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend", "eos_token": "<e>"})
    )
    monkeypatch.setattr(peers, "make_venv", lambda name, **kwargs: peers.venv_python(name))
    seen_tokenizer_configs = []

    def run_checked(command, what, env=None):
        command = [str(c) for c in command]
        if "--outfile" in command:  # the converter: source directory, ..., --outfile F32
            source = Path(command[2])
            config = (source / "tokenizer_config.json").read_text()
            seen_tokenizer_configs.append(json.loads(config))
            Path(command[command.index("--outfile") + 1]).write_text("f32")
        else:  # llama_model_quantize F32 OUT
            Path(command[-1]).write_text(f"quantized from {Path(command[-2]).read_text()}")

    monkeypatch.setattr(peers, "_run_checked", run_checked)
    made = []
    worker = threading.Thread(
        target=lambda: made.append(peers.model_path("llamacpp", "q8_0", checkpoint)), daemon=True
    )
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "model_path('llamacpp', 'q8_0') waits on its own lock"
    assert made[0].read_text() == "quantized from f32"
    assert seen_tokenizer_configs == [
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<e>"}
    ]
    assert json.loads((checkpoint / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "TokenizersBackend"
    )

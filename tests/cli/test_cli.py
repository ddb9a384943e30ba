"""Every CLI command and its error paths, run in-process through ``main`` (one subprocess test
checks the installed console script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnexport import ort_kernels
from attnexport.artifact import file_digest
from attnexport.cli.main import main
from tests.cli.helpers import run_cli


def test_console_script_prints_help_and_version():
    exe = Path(sys.executable).with_name("attnexport")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "attnexport.cli.main"]
    out = subprocess.run([*command, "--help"], capture_output=True, text=True, check=True)
    for name in ("export", "run", "serve", "verify", "bench", "backends", "inspect", "demo"):
        assert name in out.stdout
    version = subprocess.run([*command, "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("attnexport ")


def test_export_writes_files_and_manifest(llama_export):
    manifest = json.loads((llama_export / "manifest.json").read_text())
    assert (llama_export / "model.onnx").is_file() and (llama_export / "model.pt2").is_file()
    assert manifest["architecture"] == "llama" and manifest["kind"] == "decoder"
    assert manifest["cache"]["block_size"] == 16 and manifest["cache"]["num_layers"] == 2
    assert manifest["files"] == {"onnx": "model.onnx", "pt2": "model.pt2"}
    assert set(manifest["versions"]) >= {"attnexport", "torch", "onnx", "onnxruntime"}


def test_run_json_is_one_object_and_executors_agree(llama_export, capsys):
    results = {}
    for executor in ("ort", "torch"):
        prompts = ["--prompt-ids", "1,2,3", "--prompt-ids", "9,8"]
        flags = ["--max-tokens", "5", "--executor", executor, "--json"]
        code, out, _ = run_cli(capsys, "run", llama_export, *prompts, *flags)
        assert code == 0
        results[executor] = json.loads(out)  # exactly one JSON object
    outputs = results["ort"]["outputs"]
    assert len(outputs) == 2 and all(len(o["token_ids"]) == 5 for o in outputs)
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert results["ort"] == results["torch"]


def test_run_stops_on_stop_token(llama_export, capsys):
    _, out, _ = run_cli(
        capsys, "run", str(llama_export), "--prompt-ids", "1,2,3", "--max-tokens", "6", "--json"
    )
    first = json.loads(out)["outputs"][0]["token_ids"]
    stop = ["--stop-token-ids", str(first[1])]
    code, out, _ = run_cli(
        capsys, "run", llama_export, "--prompt-ids", "1,2,3", "--max-tokens", "6", *stop, "--json"
    )
    stopped = json.loads(out)["outputs"][0]
    assert code == 0 and stopped == {
        "token_ids": first[:2],
        "finish_reason": "stop",
        "prompt_token_ids": [1, 2, 3],
        "text": None,  # the zoo model has no tokenizer
    }


def test_run_human_output(llama_export, capsys):
    sampling = ["--temperature", "0.8", "--top-k", "5", "--seed", "1"]
    code, out, _ = run_cli(
        capsys, "run", llama_export, "--prompt-ids", "4,5", "--max-tokens", "3", *sampling
    )
    assert code == 0 and "prompt 0" in out and "finish: length" in out


def test_verify_table_and_json(llama_export, capsys):
    code, out, _ = run_cli(capsys, "verify", str(llama_export), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["reference"] == "eager[sdpa]"
    legs = {c["leg"] for c in report["comparisons"]}
    assert {"pt2", "onnx"} <= legs
    if ort_kernels.unavailable_reason() is None:
        assert "onnx[native]" in legs
    assert all(c["max_abs"] <= c["tolerance"] for c in report["comparisons"])
    code, out, _ = run_cli(capsys, "verify", str(llama_export))
    assert code == 0 and "onnx" in out and "within tolerance" in out


def test_verify_fails_when_the_onnx_file_is_wrong(llama_export, tmp_path, capsys):
    """A different model's ONNX in the directory makes verify exit 1."""
    broken = tmp_path / "broken"
    shutil.copytree(llama_export, broken)
    assert main(["export", "llama", "--seed", "7", "--out", str(tmp_path / "other")]) == 0
    shutil.copy(tmp_path / "other" / "model.onnx", broken / "model.onnx")
    # a manifest that records the swapped file (a swap without it is refused: test_artifact.py)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["file_digests"]["model.onnx"] = file_digest(broken / "model.onnx")
    (broken / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    code, out, _ = run_cli(capsys, "verify", str(broken), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert any(c["leg"] == "onnx" and not c["ok"] for c in report["comparisons"])


def test_inspect(llama_export, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(llama_export / "model.onnx"), "--json")
    summary = json.loads(out)
    assert code == 0
    assert summary["custom_nodes"] == {
        "attnexport::PagedAttention": 2,
        "attnexport::ReshapeAndCache": 2,
        "attnexport::NeoxQKVRotaryEmbedding": 2,
        "attnexport::FusedAddRMSNorm": 4,
        # the projections and the (untied) logits projection; gate/up with its SiluAndMul
        "attnexport::PackedMatMul": 7,
        "attnexport::PackedMatMulSiluAndMul": 2,
    }
    assert len(summary["cache_ports"]) == 4
    assert summary["cache_ports"][0] == {"input": "kv_caches_0", "output": "kv_caches_0_out"}
    assert summary["metadata"]["architecture"] == "llama"
    code, out, _ = run_cli(capsys, "inspect", str(llama_export))
    assert code == 0 and "attnexport::PagedAttention" in out and "cache ports: 4" in out


def test_backends(capsys):
    code, out, _ = run_cli(capsys, "backends", "--json")
    report = {b["name"]: b for b in json.loads(out)["backends"]}
    assert code == 0 and report["sdpa"]["available"]
    assert report["sdpa"]["capabilities"]["ALiBi"] == "yes"
    for name, entry in report.items():
        assert entry["available"] or entry["unavailable_reason"], name
    code, out, _ = run_cli(capsys, "backends")
    assert code == 0 and "sdpa" in out


def test_bench_passes_arguments_to_the_script(capsys):
    code = main(["bench", "export", "--help"])
    assert code == 0


def test_demo(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "demo", "--out", str(tmp_path / "demo"))
    assert code == 0
    assert "identical tokens on both executors" in out and "ok" in out
    assert (tmp_path / "demo" / "model.onnx").is_file()


# ----------------------------------------------------------------------------- user errors


def _unsupported_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "mixtral"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]})
    )
    return path


@pytest.mark.parametrize(
    "argv,message",
    [
        (["export", "no-such-model", "--out", "{tmp}/x"], "neither a checkpoint directory nor"),
        (["export", "{tmp}/missing/ckpt", "--out", "{tmp}/x"], "is not a directory"),
        # the zoo has no mixtral: the transformers path takes it and finds no weights
        (["export", "{mixtral}", "--out", "{tmp}/x"], "expected model.safetensors"),
        (["export", "{mixtral}", "--out", "{tmp}/x", "--impl", "zoo"], "unsupported architecture"),
        (["export", "llama", "--out", "{tmp}/x", "--block-size", "0"], "--block-size"),
        (["run", "{tmp}/nowhere", "--prompt-ids", "1"], "does not exist"),
        (["run", "{export}"], "no prompt"),
        (["run", "{export}", "--prompt", "hello"], "has no tokenizer"),
        (["run", "{export}", "--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["run", "{export}", "--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
        (["run", "{export}", "--prompt-ids", "100000"], "vocab"),
        (
            ["run", "{export}", "--prompt-ids", "1", "--backend", "xformers"],
            "--backend xformers: not available here",
        ),
        (["verify", "{tmp}"], "has no manifest.json"),
        (["inspect", "{tmp}/nothing.onnx"], "no such ONNX file"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_user_errors_are_one_line_with_exit_code_2(argv, message, tmp_path, llama_export, capsys):
    values = {"tmp": tmp_path, "export": llama_export}
    if "{mixtral}" in argv:
        values["mixtral"] = _unsupported_checkpoint(tmp_path)
    argv = [a.format(**values) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(f"attnexport {argv[0]}: error: ")
    assert message in lines[0]


def test_debug_shows_the_traceback(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--debug", "verify", str(tmp_path))
    assert code == 2 and "Traceback" in err

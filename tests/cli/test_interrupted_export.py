"""An export is all there or not there. SIGINT during ``export --weights int4`` used to leave a
complete float ``model.onnx`` without manifest, which ``run`` and ``serve`` loaded silently as
the float model; ``--overwrite`` removed the earlier export before writing the new one; a full
disk was an internal error (and, writing ``model.pt2``, a torch abort). Now the export is
written into a staging directory and moved into place when complete: the target is absent or
the earlier export intact, and a full disk is a one-line error."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attnexport.artifact import ExportOptions, export_artifact, read_manifest, resolve_artifact
from attnexport.artifact.staging import STAGING_PREFIX
from tests.cli.helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]
INT4_OVER = ("--overwrite", "--weights", "int4")
CLI = [sys.executable, "-c", "import sys; from attnexport.cli import main; sys.exit(main())"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_sigint_during_quantization_keeps_the_earlier_export(llama_export, tmp_path):
    """A real ``export --weights int4 --overwrite`` subprocess gets SIGINT once the float
    model.onnx is written and checked (the checker step's line is printed when quantization
    starts). The child holds the quantization step open (a sleep before the quantizer) so
    the signal lands inside it however fast the machine quantizes a tiny model (0.1 s), and
    takes SIGINT's default handler (a suite started in the background by a non-interactive
    shell hands its children SIGINT ignored)."""
    out = tmp_path / "export"
    shutil.copytree(llama_export, out)
    before = _snapshot(out)
    slow_quantization = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import sys, time; from attnexport import lowering; quantize = lowering.quantize_weights; "
        "lowering.quantize_weights = lambda *a, **k: (time.sleep(60), quantize(*a, **k))[1]; "
        "from attnexport.cli import main; sys.exit(main())"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", slow_quantization, "export", "llama", "--out", out, *INT4_OVER],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.strip().startswith("ONNX (attnexport): checking") and line.rstrip().endswith("s)"):
            process.send_signal(signal.SIGINT)
            break
    lines += process.stderr.readlines()
    code = process.wait(timeout=120)
    assert code == 130, "".join(lines)  # interrupted (0 would be a finished export)
    assert "attnexport: interrupted" in "".join(lines)
    assert _snapshot(out) == before  # no staging directory either
    assert resolve_artifact(out)[1] == out / "model.onnx"
    assert read_manifest(out).get("weights") is None  # the float export, and it says so


def test_an_interrupted_new_export_leaves_no_directory(tmp_path):
    """Interrupted after model.pt2 is written: the target does not appear at all."""
    out = tmp_path / "new" / "export"

    def step(description: str) -> None:
        if description.startswith("ONNX"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_artifact("llama", out, ExportOptions(formats=("pt2", "onnx")), step=step)
    assert not out.exists() and list((tmp_path / "new").iterdir()) == []


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def _export_without_room(how: str, tmp_path: Path) -> tuple[int, str, list[str]]:
    """``export llama --format both`` with 200 KB of room (model.pt2 is 500 KB): on a tiny
    tmpfs (ENOSPC; a mount namespace of its own, as unprivileged user) or under a file size
    limit (EFBIG). Returns the exit code, stderr and what the target's parent holds after."""
    argv = [*CLI, "export", "llama", "--json", "--format", "both", "--out"]  # no progress
    if how == "file size limit":
        parent = tmp_path / "disk"
        parent.mkdir()

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))

        result = subprocess.run(
            [*argv, parent / "out"], preexec_fn=limit, capture_output=True, text=True, env=_env()
        )
        return result.returncode, result.stderr, sorted(os.listdir(parent))
    mount = tmp_path / "disk"
    mount.mkdir()
    script = (
        'dir="$1"; shift; mount -t tmpfs -o size=200k tmpfs "$dir" || exit 99; '
        '"$@" "$dir/out" 2>&1 >/dev/null; code=$?; echo "LEFT:$(ls -A "$dir")"; exit $code'
    )
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    result = subprocess.run([*namespace, mount, *argv], capture_output=True, text=True, env=_env())
    err, _, left = result.stdout.rpartition("LEFT:")
    return result.returncode, err + result.stderr, left.split()


@pytest.mark.parametrize("how", ["file size limit", "full disk"])
def test_no_room_for_the_export_is_a_one_line_error(how, tmp_path):
    if how == "full disk" and not _unshare_works():
        pytest.skip("no user and mount namespaces here (unshare) to mount a tiny tmpfs")
    code, err, left = _export_without_room(how, tmp_path)
    assert code == 2, err
    reason = "File too large" if how == "file size limit" else "No space left on device"
    assert_one_line_error(err, "export", f"--out: {reason} while writing the export")
    assert left == [], left  # no directory, no staging directory, no half-written model


def test_the_staging_directory_never_outlives_an_export(llama_export, tmp_path):
    """A successful --overwrite leaves only the export's files (and the user's own)."""
    out = tmp_path / "export"
    shutil.copytree(llama_export, out)
    (out / "notes.txt").write_text("mine")
    manifest = json.loads((out / "manifest.json").read_text())
    export_artifact("llama", out, ExportOptions(formats=("pt2",), overwrite=True))
    assert sorted(os.listdir(out)) == ["manifest.json", "model.pt2", "notes.txt"]
    assert not any(name.startswith(STAGING_PREFIX) for name in os.listdir(out))
    assert read_manifest(out)["files"] == {"pt2": "model.pt2"} != manifest["files"]

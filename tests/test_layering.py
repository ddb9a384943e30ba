"""The import graph docs/architecture.md draws: the layers contract of pyproject.toml
(import-linter), no import cycle between attnexport's modules, and the ops layer loading none
of the layers above it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

grimp = pytest.importorskip("grimp", reason="import-linter is a dev dependency")


def test_the_layers_contract_is_kept() -> None:
    from importlinter.cli import lint_imports

    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    assert status == 0, "lint-imports: a layer imports one above it (its output says which)"


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    """Type annotations included: an import under TYPE_CHECKING is an import (the backend
    registry once imported the op slices' call types so, while they imported it)."""
    graph = grimp.build_graph("attnexport", exclude_type_checking_imports=False, cache_dir=None)
    assert _cycles(graph) == []


def _loaded_by(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    code = (
        f"import json, sys; {statement}; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_ops_layer_loads_neither_the_runtime_nor_the_lowering() -> None:
    above = ("attnexport.runtime", "attnexport.lowering", "onnx")
    assert _loaded_by("import attnexport.custom_ops", above) == []


# The deployment install (`pip install attnexport`, no extras): this prelude hides from every
# import finder the top-level modules HIDDEN (set below it) names, so that importing them fails
# and importlib.util.find_spec finds nothing, as where they are not installed.
HIDING = """
import sys

class _Hidden:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [_Hidden(finder) for finder in sys.meta_path]
"""


def _base_install() -> set[str]:
    """The distributions `pip install attnexport` installs: pyproject's dependencies and theirs
    (as installed here), without extras."""
    import importlib.metadata

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pending = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found: set[str] = set()
    while pending:
        requirement = Requirement(pending.pop())
        name = canonicalize_name(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        pending += importlib.metadata.requires(requirement.name) or []
    return found


def _deployment_prelude() -> str:
    """The prelude hiding every module of this venv that `pip install attnexport` would not
    install: torch and onnxscript (the [export] extra), the dev and hf extras' packages, and what
    they brought (jinja2 came with torch: chat templates need it, transformers does not require
    it, so the base install once lacked it)."""
    import importlib.metadata

    from packaging.utils import canonicalize_name

    base = _base_install() | {"attnexport"}
    hidden = sorted(
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if not {canonicalize_name(owner) for owner in owners} & base
    )
    assert {"torch", "onnxscript"} <= set(hidden)
    return f"HIDDEN = {set(hidden)!r}\n" + HIDING


# Serves an artifact through the CLI and the Engine API; prints what each returned.
SERVE = """
import contextlib, io, json, sys
from attnexport.cli import main
from attnexport.runtime import Engine, SamplingParams
from attnexport.runtime.text import Tokenizer

artifact, elsewhere, tokenizer_dir = sys.argv[1:4]

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

tokenizer = Tokenizer.from_directory(tokenizer_dir)
text = {
    "encode": tokenizer.encode("Hello world"),
    "chat": tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]),
}
engine = Engine.from_path(artifact)
outputs = engine.generate([[1, 2, 3], [7, 8]], SamplingParams(max_tokens=8))
print(json.dumps({
    "run": cli("run", artifact, "--prompt-ids", "1,2,3", "--max-tokens", "8", "--json"),
    "inspect": cli("inspect", artifact, "--json"),
    "backends": cli("backends", "--json"),
    "export": cli("export", "llama", "--out", elsewhere),
    "verify": cli("verify", artifact),
    "engine": {"tokens": [o.token_ids for o in outputs], "describe": engine.describe()},
    "text": text,
    "loaded": sorted(m for m in ("torch", "onnxscript") if m in sys.modules),
}))
"""


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory) -> Path:
    from attnexport.artifact import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("deploy") / "llama"
    export_artifact("zoo:llama", out, ExportOptions(formats=("onnx",)))
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tests.text_tokenizers import byte_level_bpe

    return byte_level_bpe(tmp_path_factory.mktemp("tokenizer"))


def _serve(artifact: Path, tokenizer: Path, tmp_path: Path, prelude: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            prelude + SERVE,
            str(artifact),
            str(tmp_path / "out"),
            str(tokenizer),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # transformers' import-time advice that its models need torch is not shown
    assert "PyTorch was not found" not in done.stderr
    return json.loads(done.stdout)


def test_serving_an_onnx_artifact_needs_no_torch(onnx_artifact, tokenizer_dir, tmp_path):
    """`run`, `inspect`, `backends`, the Engine API and the tokenizer (text, chat template) on
    an ONNX artifact exported with torch, in a process that can import only what `pip install
    attnexport` installs (no torch, no onnxscript): the same results as with everything;
    `export` and `verify` name the extra to install."""
    deploy = _serve(onnx_artifact, tokenizer_dir, tmp_path, _deployment_prelude())
    full = _serve(onnx_artifact, tokenizer_dir, tmp_path, "")
    assert deploy["text"] == full["text"]
    assert deploy["loaded"] == []
    for command in ("run", "inspect", "backends"):
        assert deploy[command]["code"] == 0, deploy[command]["stderr"]
    assert json.loads(deploy["run"]["stdout"]) == json.loads(full["run"]["stdout"])
    assert deploy["engine"]["tokens"] == full["engine"]["tokens"]
    assert json.loads(deploy["inspect"]["stdout"]) == json.loads(full["inspect"]["stdout"])
    backends = json.loads(deploy["backends"]["stdout"])
    assert backends["backends"] == []
    assert 'pip install "attnexport[export]"' in backends["torch_unavailable_reason"]
    assert (
        backends["onnxruntime_kernels"]
        == json.loads(full["backends"]["stdout"])["onnxruntime_kernels"]
    )
    for command in ("export", "verify"):
        assert deploy[command]["code"] == 2
        assert "needs torch, which is not installed" in deploy[command]["stderr"]
        assert 'pip install "attnexport[export]"' in deploy[command]["stderr"]

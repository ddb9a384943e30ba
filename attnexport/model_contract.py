"""The graph contract: what an exported model promises the runtime that loads it (which inputs
are KV caches and which outputs their in-place updates, the cache geometry, the target), stored
in the file's ONNX ``metadata_props``. Not the per-step attention metadata
(``attnexport.custom_ops.AttentionMetadata``), which the runtime builds every step.

Keys (all values are strings; lists and maps are JSON):

===========================  ==============================================================
``attnexport_version``       version of attnexport that wrote the file
``attnexport_domain``        ``attnexport:1``, the custom domain and its version
``target``                   ``attnexport``, ``standard`` or ``ort-cuda``
``cache_layout``             ``num_blocks,block_size,num_kv_heads,head_size``
``block_size``               tokens per cache block, e.g. ``16``
``num_layers``               layers with a self-attention cache (key + value tensor each)
``num_cross_layers``         layers with a cross-attention cache (only when > 0)
``num_kv_heads``             KV heads per cache tensor
``head_size``                head size
``dtype``                    the model's (activations') dtype as torch names it: ``float32``,
                             ``bfloat16``, ...; also the cache dtype unless
``kv_cache_dtype``           the caches' dtype when it differs from ``dtype`` (``float16``,
                             ``bfloat16``, ``int8``); absent: ``dtype``
``cache_inputs``             JSON list of every cache graph input, in forward order (int8
                             caches: per layer the two caches, then their two scale caches)
``cache_outputs``            JSON object ``{cache input: its output}`` for written caches,
                             always ``{"X": "X_out"}``
``outputs``                  JSON list of the non-cache graph outputs, in order
``fusions``                 JSON object ``{rewrite rule: times it fired}`` of the rules of
                             ``attnexport.lowering.fusions`` that fired (absent: none)
``rope_switch_length``       LongRoPE models only: the sequence length past which keys are
                             rotated with the long factors (the engine recomputes a
                             sequence crossing it); absent: no such switch
===========================  ==============================================================

Caller-supplied metadata (for instance ``architecture``) is added under its own keys. The
geometry keys are absent when the model has no cache.

This is the contract between the lowering, which writes the file, and the runtime, which reads
it; it imports neither torch nor onnx (the serving core reads it without them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from attnexport._version import __version__
from attnexport.errors import UserError

DOMAIN = "attnexport"
"""The ONNX domain of the attnexport nodes (public: exported files name it)."""
DOMAIN_VERSION = 1

PREFILL_ATTENTION = ("float32", "bfloat16")
"""How the native PagedAttention kernel multiplies prefills (``export --prefill-attention``;
``bfloat16``: the nodes' ``prefill_bf16`` = 1)."""

CACHE_LAYOUT = "num_blocks,block_size,num_kv_heads,head_size"

_GEOMETRY = ("block_size", "num_layers", "num_cross_layers", "num_kv_heads", "head_size")


@dataclass(frozen=True)
class GraphContract:
    """What :func:`attnexport.lowering.to_onnx` records in ``metadata_props``."""

    target: str
    cache_inputs: tuple[str, ...] = ()
    cache_outputs: dict[str, str] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    block_size: int | None = None
    num_layers: int | None = None
    num_cross_layers: int = 0
    num_kv_heads: int | None = None
    head_size: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    """The caches' dtype when it differs from ``dtype`` (None: ``dtype``); int8 caches have
    float32 scale caches among ``cache_inputs``."""
    rope_switch_length: int | None = None
    """The model's ``rope_switch_length`` (LongRoPE), or None."""
    fusions: dict[str, int] = field(default_factory=dict)
    """The rewrite rules that fired at export and how often (``attnexport.lowering.fusions``)."""
    attnexport_version: str = __version__
    extra: dict[str, str] = field(default_factory=dict)
    """Caller-supplied keys (e.g. ``architecture``)."""

    @property
    def cache_dtype(self) -> str | None:
        """The dtype the caches have (``kv_cache_dtype``, else ``dtype``)."""
        return self.kv_cache_dtype or self.dtype

    def to_props(self) -> dict[str, str]:
        props = {
            "attnexport_version": self.attnexport_version,
            "attnexport_domain": f"{DOMAIN}:{DOMAIN_VERSION}",
            "target": self.target,
            "cache_inputs": json.dumps(list(self.cache_inputs)),
            "cache_outputs": json.dumps(self.cache_outputs),
            "outputs": json.dumps(list(self.outputs)),
        }
        if self.block_size is not None:
            props["cache_layout"] = CACHE_LAYOUT
            props["dtype"] = str(self.dtype)
            if self.kv_cache_dtype not in (None, self.dtype):
                props["kv_cache_dtype"] = self.kv_cache_dtype
            for key in _GEOMETRY:
                value = getattr(self, key)
                if value is not None and not (key == "num_cross_layers" and value == 0):
                    props[key] = str(value)
        if self.rope_switch_length is not None:
            props["rope_switch_length"] = str(self.rope_switch_length)
        if self.fusions:
            props["fusions"] = json.dumps(self.fusions)
        clash = sorted(set(props) & set(self.extra))
        if clash:
            raise ValueError(f"metadata: keys {clash} are written by attnexport itself")
        return {**props, **self.extra}

    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> GraphContract:
        """Parses ``metadata_props`` (or onnxruntime's ``custom_metadata_map``)."""
        if "attnexport_version" not in props:
            # the file is the user's (run / Engine.from_path on another tool's ONNX model)
            raise UserError("metadata: not an attnexport model (no 'attnexport_version' key)")
        ours = {
            *_GEOMETRY,
            "attnexport_domain",
            "attnexport_version",
            "target",
            "cache_layout",
            "dtype",
            "kv_cache_dtype",
            "cache_inputs",
            "cache_outputs",
            "outputs",
            "rope_switch_length",
            "fusions",
        }
        extra = {k: v for k, v in props.items() if k not in ours}

        def integer(key):
            return int(props[key]) if key in props else None

        return cls(
            target=props["target"],
            cache_inputs=tuple(json.loads(props.get("cache_inputs", "[]"))),
            cache_outputs=dict(json.loads(props.get("cache_outputs", "{}"))),
            outputs=tuple(json.loads(props.get("outputs", "[]"))),
            block_size=integer("block_size"),
            num_layers=integer("num_layers"),
            num_cross_layers=integer("num_cross_layers") or 0,
            num_kv_heads=integer("num_kv_heads"),
            head_size=integer("head_size"),
            dtype=props.get("dtype"),
            kv_cache_dtype=props.get("kv_cache_dtype"),
            rope_switch_length=integer("rope_switch_length"),
            fusions=dict(json.loads(props.get("fusions", "{}"))),
            attnexport_version=props["attnexport_version"],
            extra=extra,
        )


def read_contract(model) -> GraphContract:
    """The graph contract of an ONNX model (``onnx.ModelProto``, a path, or an
    ``onnxruntime.InferenceSession``; onnx is imported for the first two only)."""
    if hasattr(model, "get_modelmeta"):
        return GraphContract.from_props(model.get_modelmeta().custom_metadata_map)
    import onnx

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    return GraphContract.from_props({p.key: p.value for p in model.metadata_props})

"""The graph contract: what an exported model promises the runtime that loads it (which inputs
are KV caches and which outputs their in-place updates, the cache geometry, the target), stored
in the file's ONNX ``metadata_props``. Not the per-step attention metadata
(:class:`~attnexport.custom_ops.AttentionMetadata`), which the runtime builds every step.

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
``dtype``                    cache dtype as torch names it: ``float32``, ``bfloat16``, ...
``cache_inputs``             JSON list of every cache graph input, in forward order
``cache_outputs``            JSON object ``{cache input: its output}`` for written caches,
                             always ``{"X": "X_out"}``
``outputs``                  JSON list of the non-cache graph outputs, in order
===========================  ==============================================================

Caller-supplied keys (for instance ``architecture``) is added under its own keys. The
geometry keys are absent when the model has no cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attnexport._version import __version__
from attnexport.custom_ops.onnx_spec import DOMAIN, DOMAIN_VERSION
from attnexport.errors import UserError
from attnexport.model_interface import CacheSpec

CACHE_LAYOUT = "num_blocks,block_size,num_kv_heads,head_size"

_GEOMETRY = ("block_size", "num_layers", "num_cross_layers", "num_kv_heads", "head_size")


@dataclass(frozen=True)
class GraphContract:
    """What :func:`attnexport.lowering.to_onnx` records in ``metadata_props``: the contract
    between the graph and the runtime that binds its caches."""

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
    attnexport_version: str = __version__
    extra: dict[str, str] = field(default_factory=dict)
    """Caller-supplied keys (e.g. ``architecture``)."""

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
            for key in _GEOMETRY:
                value = getattr(self, key)
                if value is not None and not (key == "num_cross_layers" and value == 0):
                    props[key] = str(value)
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
            "cache_inputs",
            "cache_outputs",
            "outputs",
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
            attnexport_version=props["attnexport_version"],
            extra=extra,
        )


def read_contract(model) -> GraphContract:
    """The graph contract of an ONNX model (``onnx.ModelProto``, a path, or an
    ``onnxruntime.InferenceSession``), read from its ``metadata_props``."""
    import onnx

    if hasattr(model, "get_modelmeta"):
        return GraphContract.from_props(model.get_modelmeta().custom_metadata_map)
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    return GraphContract.from_props({p.key: p.value for p in model.metadata_props})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_geometry(
    caches: Mapping[str, torch.Tensor], cache_spec: CacheSpec | None
) -> dict[str, int | str | None]:
    """block_size, num_layers, num_cross_layers, num_kv_heads, head_size and dtype of the
    sample cache tensors, checked against ``cache_spec`` when one is given."""
    if not caches:
        return {}
    first = next(iter(caches.values()))
    found = {
        "block_size": int(first.shape[1]),
        "num_kv_heads": int(first.shape[2]),
        "head_size": int(first.shape[3]),
        "dtype": dtype_name(first.dtype),
    }
    for name, cache in caches.items():
        geometry = (tuple(cache.shape[1:]), cache.dtype)
        if geometry != (tuple(first.shape[1:]), first.dtype):
            raise ValueError(
                f"{name}: expected a cache like the others, [num_blocks, "
                f"{', '.join(map(str, first.shape[1:]))}] {first.dtype}, got "
                f"{list(cache.shape)} {cache.dtype}"
            )
    if cache_spec is None:
        return {**found, "num_layers": len(caches) // 2, "num_cross_layers": 0}
    expected = {
        "block_size": cache_spec.block_size,
        "num_kv_heads": cache_spec.num_kv_heads,
        "head_size": cache_spec.head_size,
        "dtype": dtype_name(cache_spec.dtype),
    }
    for key, value in expected.items():
        if found[key] != value:
            raise ValueError(
                f"cache_spec: {key} is {value} but the sample caches have {found[key]}"
            )
    if cache_spec.num_cache_tensors != len(caches):
        raise ValueError(
            f"cache_spec: expected {cache_spec.num_cache_tensors} cache inputs "
            f"(2 * (num_layers + num_cross_layers)), the model uses {len(caches)}"
        )
    return {
        **found,
        "num_layers": cache_spec.num_layers,
        "num_cross_layers": cache_spec.num_cross_layers,
    }

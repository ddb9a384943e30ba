"""The suites whose outcome depends on torch's version, IPEX or xFormers: all that ``make
test-ipex`` runs again in ``.venv-ipex`` (torch 2.8, IPEX 2.8, xFormers) after ``make
test-main`` ran the whole suite on the newest torch (``ATTNEXPORT_TORCH_DEPENDENT_ONLY=1``
deselects every other test; docs/testing.md).

In ``.venv-ipex`` the ``auto`` backend is IPEX, so every eager op call of a selected test runs
IPEX's kernels. What torch's version changes: the kernels (IPEX, torch's SDPA, xFormers), the
ops' torch faces (schemas, fake kernels, ``opcheck``), ``torch.export`` and ``torch.onnx``
(the graphs an export writes, the ``.pt2`` it saves and loads) and ``torch.load``. What it
does not: single attnexport nodes built by hand and run in onnxruntime (bodies, native
kernels, the fuzz suite's ONNX targets), the engine's scheduling, block accounting, sampler,
text and server (the serving core imports no torch: tests/runtime/test_torch_free_core.py),
the kernel build and the packaging; those run once, in ``.venv``. A model family's parity
with transformers runs one representative case per kind of model (decoder-only, the
transformers path, encoder-decoder, encoder): the torch side of every family is the same
ops and the same export, and ``.venv`` runs them all.
"""

from __future__ import annotations

SUITES: dict[str, tuple[str, ...] | None] = {
    # the kernels themselves and the backend dispatch
    "tests/backends/": None,
    # torch faces, fake kernels, opcheck, torch.export of the ops, eager ops vs the reference
    "tests/custom_ops/": None,
    # the eager targets of the CPU backends; the ONNX targets build single nodes by hand
    "tests/fuzz/test_fuzz_ops.py::test_fuzz[ipex-": None,
    "tests/fuzz/test_fuzz_ops.py::test_fuzz[sdpa-": None,
    # torch.export and torch.onnx: programs, graphs, their contract, in-place cache writes in
    # onnxruntime, the three targets, the ONNX faces against the torch faces
    "tests/lowering/test_export.py": None,
    "tests/lowering/test_roundtrip.py": None,
    "tests/lowering/test_targets.py": None,
    "tests/lowering/test_model_contract.py": None,
    "tests/lowering/test_inplace.py": None,
    "tests/lowering/test_registry.py": None,
    "tests/lowering/test_gemm_to_matmul.py": None,
    # torch.onnx's translation without its retrace reaches into its private exporter
    "tests/lowering/test_onnx_translation.py": None,
    # every zoo model's eager forward and export sample; checkpoints through torch.load
    "tests/models/test_zoo.py": None,
    "tests/models/test_checkpoints.py": None,
    "tests/models/test_rope.py": None,
    # one case per kind of model: the richest decoder (q/k norms, per-layer RoPE, windows, soft
    # caps) on every leg, the engine's included; one transformers-path family; one BART
    "tests/models/test_decoder_parity.py": ("gemma3-qknorm-localrope-window",),
    "tests/models/test_transformers_path.py": ("[mixtral-", "test_unsupported_models"),
    "tests/models/test_bart_parity.py": ("untied-gelu_new-heads",),
    "tests/models/test_bert_parity.py": None,
    # the engine on eager torch (IPEX kernels), .pt2 and onnxruntime, backends compared
    "tests/runtime/test_engine.py": None,
    "tests/runtime/test_executors.py": None,
    "tests/runtime/test_engine_encoder_decoder.py": None,
    "tests/runtime/test_kv_cache_dtype_engine.py": None,
    # export of every dtype; loading an untrusted .pt2 (torch.export.load, pickle)
    "tests/cli/test_cli_dtypes.py": None,
    "tests/cli/test_unsafe_pt2.py": None,
    # the decode benchmark's IPEX legs
    "tests/benchmarks/test_decode_attention.py": None,
}
"""Node id prefix -> ``None`` (every test under it) or substrings, one of which a test's node
id must hold."""


def matches(entry: str, nodeid: str) -> bool:
    """Whether the test ``nodeid`` is one of the tests the :data:`SUITES` key ``entry`` names."""
    only = SUITES[entry]
    return nodeid.startswith(entry) and (only is None or any(s in nodeid for s in only))


def may_hold_any(path: str) -> bool:
    """Whether the file or directory ``path`` (relative to the root, ``/``-separated) may hold
    a test of :data:`SUITES` (the others are not even collected)."""
    for entry in SUITES:
        file = entry.split("::")[0]  # a test file, or a directory ending in /
        if file.startswith(f"{path}/") or file.rstrip("/") == path:
            return True  # a directory above it, or itself
        if file.endswith("/") and path.startswith(file):
            return True  # inside a listed directory
    return False


def select(nodeids: list[str], whole_suite: bool) -> list[bool]:
    """Which of ``nodeids`` are torch-dependent. ``whole_suite``: the ids are the whole suite's,
    so every entry must select a test (a renamed file or case would silently leave the torch 2.8
    run otherwise): raises ``LookupError`` naming the entries that select none."""
    hits = {entry: [matches(entry, nodeid) for nodeid in nodeids] for entry in SUITES}
    unmatched = [entry for entry, hit in hits.items() if not any(hit)]
    if whole_suite and unmatched:
        raise LookupError(f"tests/torch_dependent.py: no test matches {unmatched}")
    return [any(hit[i] for hit in hits.values()) for i in range(len(nodeids))]

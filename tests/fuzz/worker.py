"""The worker side of the fuzz harness: runs fuzz cases on one target in its own process.

A target is a kernel backend (``sdpa``, ``ipex``, ...: the eager op under ``use_backend``) or an
ONNX path (``onnx-bodies``: one attnexport node run by its standard-op function body on stock
onnxruntime; ``onnx-native``: the same node with the native kernels registered). The parent
(:mod:`tests.fuzz.harness`) sends pickled :class:`FuzzCase` objects and gets back an
:class:`Outcome` per case; a crash or a hang shows up there as a dead or silent worker. This
module imports neither pytest nor hypothesis: it is what a spawned worker loads.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import time
from dataclasses import dataclass, field

import torch

ONNX_TARGETS = ("onnx-bodies", "onnx-native")

# The node of each op in an exported graph, and its output names.
ONNX_NODES = {
    "reshape_and_cache": ("ReshapeAndCache", ("key_cache_out", "value_cache_out")),
    "paged_attention": ("PagedAttention", ("output",)),
    "varlen_attention": ("VarlenAttention", ("output",)),
    "rotary_embedding": ("NeoxRotaryEmbedding", ("output",)),
    "qkv_rotary_embedding": ("NeoxQKVRotaryEmbedding", ("query", "key", "value")),
    "silu_and_mul": ("SiluAndMul", ("output",)),
    "fused_add_rms_norm": ("FusedAddRMSNorm", ("output", "total")),
}
IN_PLACE = {"reshape_and_cache": ("key_cache", "value_cache")}
_MATRIX_OUTPUTS = ("SiluAndMul", "FusedAddRMSNorm")
_MAX_SESSIONS = 16  # each holds threads and an arena
# The harness's own tests (tests/fuzz/test_harness.py): a crash, a hang, a huge tensor.
_SELF_TESTS = {
    "selftest_segfault": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "selftest_hang": lambda: time.sleep(3600),
    "selftest_allocate": lambda: {"out0": torch.empty(3 << 30, dtype=torch.uint8)},
}


@dataclass
class FuzzCase:
    """One call of ``op``: ``inputs`` are its tensor arguments in signature order, ``attrs`` its
    keyword arguments; ``template`` the well-formed inputs the case was derived from (an ONNX
    target builds its graph's input types and geometry attributes from them, as an export
    would); ``valid`` whether the call is well formed (then it must match the reference)."""

    op: str
    kind: str
    inputs: dict[str, torch.Tensor]
    attrs: dict[str, object]
    template: dict[str, torch.Tensor]
    valid: bool | None
    rewrite: dict[str, torch.Tensor] = field(default_factory=dict)
    """Eager targets: call the op once, then write these values into the named inputs through
    NumPy (which does not bump a tensor's version) and judge the second call."""
    inference_mode: bool = False
    """Eager targets: call the op under ``torch.inference_mode()``."""

    def final_inputs(self) -> dict[str, torch.Tensor]:
        """The inputs of the judged call."""
        return self.inputs | self.rewrite

    def __repr__(self) -> str:
        """Index tensors in full, data tensors by shape and dtype: a repro that fits a line."""

        def show(tensor) -> str:
            if isinstance(tensor, torch.Tensor):
                if tensor.is_floating_point() and tensor.numel() > 0:
                    bad = "" if bool(tensor.isfinite().all()) else ", with NaN/Inf"
                    return f"<{tuple(tensor.shape)} {tensor.dtype}{bad}>"
                return f"tensor({tensor.tolist()}, dtype={tensor.dtype})"
            return repr(tensor)

        inputs = ", ".join(f"{n}={show(t)}" for n, t in self.inputs.items())
        attrs = ", ".join(f"{n}={show(v)}" for n, v in self.attrs.items())
        rewrite = ", ".join(f"{n}={show(t)}" for n, t in self.rewrite.items())
        then = f" then via NumPy {rewrite}" if rewrite else ""
        mode = " under inference_mode" if self.inference_mode else ""
        return f"{self.op}[{self.kind}, valid={self.valid}]({inputs}; {attrs}){then}{mode}"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints failing cases so
        printer.text(repr(self))


@dataclass
class Outcome:
    """What a target did with a case: ``status`` ``"ok"`` (``outputs`` hold the results) or
    ``"raised"`` (``error_*`` describe the exception); ``before`` and ``after`` hold the inputs
    an op writes in place, as they were before and after the judged call."""

    status: str
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    after: dict[str, torch.Tensor] = field(default_factory=dict)
    error_type: str = ""
    error_module: str = ""
    error_bases: tuple[str, ...] = ()
    message: str = ""


def _limit_memory(extra_bytes: int) -> None:
    """Caps the address space at what the worker maps now plus ``extra_bytes``, so that a huge
    allocation fails (and is reported) instead of swapping the machine."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmSize:"))
    current = int(line.split()[1]) * 1024
    limit = current + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class _Runner:
    def __init__(self, target: str) -> None:
        import attnexport  # noqa: F401  (registers the ops and backends)

        self.target = target
        self._sessions: dict[tuple, object] = {}

    def run(self, case: FuzzCase) -> Outcome:
        if case.inference_mode:  # inputs made there too: inference tensors have no version
            with torch.inference_mode():
                case.inputs = {name: t.clone() for name, t in case.inputs.items()}
        if case.rewrite:
            with contextlib.suppress(Exception):  # only the second call is judged
                self._eager(case)  # validates and memoises the first metadata
            for name, values in case.rewrite.items():
                case.inputs[name].numpy()[...] = values.numpy()
        before = {name: t.clone() for name, t in self._after(case).items()}
        try:
            if case.op in _SELF_TESTS:
                outputs = _SELF_TESTS[case.op]()
            elif self.target in ONNX_TARGETS:
                outputs = self._onnx(case)
            else:
                outputs = self._eager(case)
        except Exception as error:  # the parent judges every exception; nothing is swallowed
            return Outcome(
                status="raised",
                before=before,
                after=self._after(case),
                error_type=type(error).__name__,
                error_module=type(error).__module__,
                error_bases=tuple(c.__name__ for c in type(error).__mro__),
                message=str(error)[:2000],
            )
        return Outcome(status="ok", outputs=outputs, before=before, after=self._after(case))

    @staticmethod
    def _after(case: FuzzCase) -> dict[str, torch.Tensor]:
        return {name: case.inputs[name].clone() for name in IN_PLACE.get(case.op, ())}

    def _eager(self, case: FuzzCase) -> dict[str, torch.Tensor]:
        import attnexport

        mode = torch.inference_mode() if case.inference_mode else contextlib.nullcontext()
        with attnexport.use_backend(self.target), mode:
            result = getattr(attnexport, case.op)(*case.inputs.values(), **case.attrs)
        if result is None:
            return {}
        if isinstance(result, torch.Tensor):
            result = (result,)
        return {f"out{i}": t for i, t in enumerate(result)}

    def _onnx(self, case: FuzzCase) -> dict[str, torch.Tensor]:
        op_type, output_names = ONNX_NODES[case.op]
        attrs, feeds = dict(case.attrs), dict(case.inputs)
        template = dict(case.template)
        if case.op in ("paged_attention", "varlen_attention"):
            slopes = attrs.pop("alibi_slopes", None)
            heads = template["query"].shape[1]
            feeds["alibi_slopes"] = slopes if slopes is not None else torch.zeros(heads)
            template["alibi_slopes"] = torch.zeros(heads)
            attrs["causal"] = int(attrs["causal"])
        if case.op == "qkv_rotary_embedding":
            attrs["head_size"] = template["cos"].shape[1]
        session = self._session(op_type, output_names, template, attrs)
        result = session.run(feeds)
        return {f"out{i}": result[name] for i, name in enumerate(output_names) if name in result}

    def _session(self, op_type: str, output_names, template: dict, attrs: dict):
        """A session of one ``op_type`` node typed like ``template`` (cached: building one
        costs more than running a case). Its geometry attributes come from the template's
        shapes past the token axis, so those are part of the key."""
        from attnexport.lowering.single_node import single_node_session

        signature = tuple(
            (n, t.dtype, t.dim(), tuple(t.shape[1:]) if t.is_floating_point() else ())
            for n, t in template.items()
        )
        key = (op_type, signature, tuple(sorted(attrs.items())))
        if key in self._sessions:
            self._sessions[key] = self._sessions.pop(key)  # most recently used last
        else:
            if len(self._sessions) >= _MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]
            kernels = "native" if self.target == "onnx-native" else "bodies"
            first = next(iter(template.values()))
            outputs = {
                name: (
                    template[name.removesuffix("_out")]
                    if name.endswith("_out")
                    else torch.empty((0,) * (2 if op_type in _MATRIX_OUTPUTS else 3)).to(
                        first.dtype
                    )
                )
                for name in output_names
            }
            self._sessions[key] = single_node_session(
                op_type, template, outputs, kernels, num_threads=1, **attrs
            )
        return self._sessions[key]


def serve(connection, target: str, memory_bytes: int) -> None:
    """The worker's loop: receive a pickled case, answer with a pickled outcome, until EOF."""
    runner = _Runner(target)
    _limit_memory(memory_bytes)
    connection.send_bytes(b"ready")
    while True:
        try:
            message = connection.recv_bytes()
        except EOFError:
            return
        outcome = runner.run(pickle.loads(message))
        connection.send_bytes(pickle.dumps(outcome))

"""``attnexport verify ARTIFACT``: the round trip eager vs ``.pt2`` vs ONNX, and every
available kernel backend, on a batch unlike the export sample.

Every leg runs the same teacher-forced steps (a ragged prefill, then decode steps with fixed
tokens) through :class:`~attnexport.runtime.step_driver.PagedDriver` with its own caches; the
reference is the eager model on the ``sdpa`` backend. When the artifact comes from a checkpoint
that is still there and transformers is installed, a ``transformers`` leg runs the checkpoint in
transformers on the same batch (logits) and compares its greedy tokens with the engine's on the
artifact (:mod:`attnexport.cli.verify_hf`). Exit code 1 when an error exceeds the tolerance of
:func:`attnexport.tolerances.model_tolerance` or a greedy token differs.

The batch is English text (:mod:`attnexport.cli.verify_text`) when the artifact has a tokenizer
(prompts cut from it, the text's next tokens appended at the decode steps), else random tokens.

An artifact with quantized weights (manifest ``weights``, ``export --weights int4|int8``)
compares its ONNX legs with the float eager model by what quantization costs, over every logits
row of the batch: max abs logit error, top-1 agreement, mean KL divergence and perplexity
increase (of the batch's next tokens), plus the share of *confident* tokens whose top-1 changed;
KL, perplexity increase and confident flips are bounded per format by
:func:`attnexport.tolerances.quantized_bounds` (measured on a real checkpoint; docs/cli.md). It
has no transformers leg: its greedy tokens are not the float checkpoint's.

An artifact with a KV cache dtype of its own (manifest ``kv_cache_dtype``) runs every leg on
caches of that dtype (the reference too) with the bound of
:func:`attnexport.tolerances.kv_cache_model_tolerance`; backends that cannot run it (IPEX) are
left out with the reason, and there is no transformers
leg (its float caches are not the artifact's).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnexport.artifact import artifact_dir, check_model_file, read_manifest
from attnexport.artifact.manifest import kv_cache_dtype
from attnexport.cli.errors import CliError
from attnexport.cli.flags import add_trust_flag
from attnexport.cli.progress import steps
from attnexport.errors import require

if TYPE_CHECKING:
    import torch

PROMPT_LENGTHS = (7, 3, 12)
DECODE_STEPS = 3
TEXT_PROMPTS = ((0, 48), (100, 16), (40, 80))
"""(offset, length) of each prompt cut from the verify text (token positions)."""
TEXT_DECODE_STEPS = 8


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "verify",
        help="compare eager, .pt2, ONNX and every available backend on the same steps",
    )
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT", help="an export directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token batch")
    add_trust_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


@dataclass
class Comparison:
    """One output of one leg against the reference: by max abs error against ``tolerance``,
    or, for a leg on quantized weights, by the ``quality`` figures against ``bounds``
    (:func:`attnexport.tolerances.quantized_bounds`)."""

    leg: str
    output: str
    max_abs: float
    max_rel: float
    tolerance: float
    quality: dict | None = None
    bounds: dict | None = None

    @property
    def ok(self) -> bool:
        if self.bounds is not None:
            return all(self.quality[name] <= bound for name, bound in self.bounds.items())
        return self.max_abs <= self.tolerance

    def to_json(self) -> dict:
        result = {
            "leg": self.leg,
            "output": self.output,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "tolerance": self.tolerance,
        }
        if self.quality is not None:
            result |= self.quality | {"bounds": self.bounds}
        return result | {"ok": self.ok}


Leg = Callable[..., "torch.Tensor"]
"""Calls the forward with positional arguments; caches (inside them) are updated in place."""


def _onnx_leg(path: Path, input_names: list[str], native: bool) -> Leg:
    """The ONNX model in onnxruntime: the attnexport nodes' bodies, or the native kernels."""
    import onnxruntime as ort

    from attnexport import ort_kernels
    from attnexport.lowering import PagedOrtSession

    options = ort.SessionOptions()
    if native:
        ort_kernels.register(options)
    session = PagedOrtSession(path, session_options=options)

    def call(*args):
        outputs = session.run(dict(zip(input_names, args, strict=True)))
        return next(iter(outputs.values()))

    return call


def _eager_leg(model: torch.nn.Module, backend: str) -> Leg:
    import torch

    from attnexport.custom_ops import use_backend

    def call(*args):
        with use_backend(backend), torch.no_grad():
            return model(*args)

    return call


def _legs(
    manifest: dict, directory: Path, model, trust_pickle: bool
) -> dict[str, Callable[[], Leg]]:
    """Every way to run this artifact here, the reference (``eager[sdpa]``) first, each as a
    function that loads it: a leg is loaded when it runs and dropped after, so the ONNX
    sessions and the ``.pt2`` never hold their weights at the same time. Only the model files
    the manifest lists are loaded, each after checking its size and SHA-256 (here, before any
    leg runs). Backends that cannot run the artifact's KV cache dtype are left out
    (:func:`skipped_legs` says why)."""
    legs: dict[str, Callable[[], Leg]] = {}
    if model is not None:
        legs["eager[sdpa]"] = lambda: _eager_leg(model, "sdpa")
        runnable, _ = _other_backends(manifest)
        for backend in runnable:
            legs[f"eager[{backend.name}]"] = lambda name=backend.name: _eager_leg(model, name)
    if "pt2" in manifest["files"]:
        from attnexport.artifact import load_pt2
        from attnexport.artifact.pt2 import inspect_pt2

        pt2 = check_model_file(manifest, directory, "pt2")
        if not trust_pickle:  # refused before any leg runs; load_pt2 checks again at load
            inspect_pt2(pt2)
        legs["pt2"] = lambda: _eager_leg(load_pt2(pt2, trust_pickle=trust_pickle).module(), "auto")
    if "onnx" in manifest["files"]:
        from attnexport import ort_kernels

        path = check_model_file(manifest, directory, "onnx")
        names = manifest["input_names"]
        legs["onnx"] = lambda: _onnx_leg(path, names, native=False)
        if ort_kernels.unavailable_reason() is None:
            legs["onnx[native]"] = lambda: _onnx_leg(path, names, native=True)
    return legs


def _cache_dtypes(manifest: dict) -> tuple[str, bool]:
    """The artifact's KV cache dtype name and whether it differs from the model's."""
    cache_dtype = kv_cache_dtype(manifest)
    return cache_dtype, cache_dtype != manifest["dtype"]


def _other_backends(manifest: dict) -> tuple[list, list]:
    """The available CPU kernel backends besides sdpa: those that run the artifact's KV cache
    dtype, and those that do not."""
    import torch

    import attnexport  # noqa: F401  (registers backends)
    from attnexport.custom_ops import registered_backends

    cache_dtype, other_caches = _cache_dtypes(manifest)
    runnable, refused = [], []
    for backend in registered_backends():
        if backend.name == "sdpa" or not backend.is_available():
            continue
        if "cpu" not in backend.capabilities.devices:
            continue
        takes = not other_caches or getattr(torch, cache_dtype) in backend.capabilities.cache_dtypes
        (runnable if takes else refused).append(backend)
    return runnable, refused


def skipped_legs(manifest: dict) -> list[str]:
    """Plain sentences on the legs left out because they cannot run the KV cache dtype."""
    _, refused = _other_backends(manifest)
    return [f"no eager[{b.name}] leg: {b.capabilities.cache_dtype_reason}" for b in refused]


def _text_tokens(manifest: dict, directory: Path) -> list[int] | None:
    """The verify text in the artifact's tokenizer; None without a tokenizer (or for models
    that are not decoders)."""
    if manifest["kind"] != "decoder" or "tokenizer.json" not in manifest["tokenizer_files"]:
        return None
    from attnexport.cli.verify_text import TEXT
    from attnexport.runtime.loading import artifact_tokenizer

    tokenizer = artifact_tokenizer(directory, manifest)
    ids = tokenizer.encode(TEXT)
    if max(o + n for o, n in TEXT_PROMPTS) + TEXT_DECODE_STEPS > len(ids):
        return None
    return ids


Batch = tuple[list[list[int]], list[list[int]]]
"""``(prompts, decode_tokens)`` of the paged legs: ``decode_tokens[k][i]`` is appended to
sequence i before decode step k + 1."""


def _batch(manifest: dict, seed: int, directory: Path) -> Batch:
    """The batch of the paged legs: cut from the verify text when the artifact has a tokenizer
    (each prompt followed by the text's next tokens), else random tokens."""
    ids = _text_tokens(manifest, directory)
    if ids is not None:
        prompts = [ids[o : o + n] for o, n in TEXT_PROMPTS]
        decode_tokens = [
            [ids[o + n + k] for o, n in TEXT_PROMPTS] for k in range(TEXT_DECODE_STEPS)
        ]
        return prompts, decode_tokens
    rng = random.Random(seed)
    vocab = manifest["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    decode_tokens = [[rng.randrange(vocab) for _ in PROMPT_LENGTHS] for _ in range(DECODE_STEPS)]
    return prompts, decode_tokens


def next_tokens(manifest: dict, batch: Batch) -> dict[str, list[int | None]]:
    """Per logits output of :func:`_run_paged`, the token that follows each of its rows in the
    batch (None where the batch does not say: the last decode step, an encoder-decoder's
    prefill)."""
    prompts, decode_tokens = batch
    steps = len(decode_tokens)
    following = [
        [*prompt[1:], *(step[i] for step in decode_tokens)] for i, prompt in enumerate(prompts)
    ]
    encoder = manifest["kind"] == "encoder-decoder"
    result = {
        "prefill logits": [
            None if encoder else following[i][j]
            for i, prompt in enumerate(prompts)
            for j in range(len(prompt))
        ]
    }
    for k in range(steps):
        result[f"decode {k + 1} logits"] = [
            decode_tokens[k + 1][i] if k + 1 < steps else None for i in range(len(prompts))
        ]
    return result


def _run_paged(leg: Leg, manifest: dict, batch: Batch, seed: int) -> dict[str, torch.Tensor]:
    """Teacher-forced steps of a (encoder-)decoder; returns ``{output name: tensor}``."""
    import torch

    from attnexport.artifact import manifest_cache_spec
    from attnexport.runtime.step_driver import PagedDriver

    spec = manifest_cache_spec(manifest)
    prompts, decode_tokens = batch
    blocks_needed = sum(
        -(-(len(p) + len(decode_tokens)) // spec.block_size) + -(-len(p) // spec.block_size) + 1
        for p in prompts
    )

    def runner(args, kv_caches):
        return leg(*args, kv_caches), kv_caches

    driver = PagedDriver(runner, spec, num_blocks=blocks_needed + 4, seed=seed)
    encoder = manifest["kind"] == "encoder-decoder"
    for prompt in prompts:
        if encoder:
            start = manifest["generation"].get("decoder_start_token_id") or 0
            driver.add([start], encoder_ids=prompt)
        else:
            driver.add(prompt)
    results = {}
    logits = driver.prefill(all_logits=True)
    results["prefill logits"] = torch.cat([logits[i] for i in sorted(logits)])
    for step, tokens in enumerate(decode_tokens):
        for seq, token in enumerate(tokens):
            driver.append(seq, token)
        logits = driver.step(dict.fromkeys(range(len(prompts)), 1))
        results[f"decode {step + 1} logits"] = torch.cat([logits[i] for i in sorted(logits)])
    results["kv caches"] = _cache_values(driver.kv_caches, spec)
    return results


def _cache_values(kv_caches: list[torch.Tensor], spec) -> torch.Tensor:
    """Every cache value as one float tensor; int8 caches dequantized (``float(q) * scale``),
    so that a row quantized one step apart counts by its value, not by 1."""
    import torch

    if not spec.scaled:
        return torch.cat([c.reshape(-1) for c in kv_caches])
    from attnexport.custom_ops.kv_cache_dtype import dequantize_rows

    groups = [kv_caches[i : i + 4] for i in range(0, len(kv_caches), 4)]
    return torch.cat(
        [
            dequantize_rows(c, s).reshape(-1)
            for k, v, ks, vs in groups
            for c, s in ((k, ks), (v, vs))
        ]
    )


def _run_encoder(leg: Leg, manifest: dict, batch: Batch, seed: int) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = manifest["vocab_size"]
    total = sum(PROMPT_LENGTHS)
    input_ids = torch.randint(0, vocab, (total,), generator=generator)
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENGTHS])
    cu_seqlens = torch.tensor(
        [0, *torch.tensor(PROMPT_LENGTHS).cumsum(0).tolist()], dtype=torch.int32
    )
    token_type_ids = torch.zeros(total, dtype=torch.int64)
    return {"hidden states": leg(input_ids, positions, cu_seqlens, token_type_ids)}


def notes(manifest: dict) -> list[str]:
    """Plain sentences on what ``verify`` could not compare: the checkpoint an artifact was
    exported from is gone (the exported files are then only compared with each other), or
    why there is no ``transformers`` leg."""
    from attnexport.cli import verify_hf

    source = manifest["source"]
    if source["kind"] == "checkpoint" and not Path(source["path"]).is_dir():
        return [
            f"the source checkpoint {source['path']} is gone: the eager model cannot be "
            "rebuilt and there is no transformers leg, so the exported files are only "
            "compared with each other"
        ]
    if manifest.get("weights") is not None and source["kind"] == "checkpoint":
        return [
            f"{manifest['weights']['format']} weights: no transformers leg (the ONNX legs are "
            "compared with the float eager model by logit error, top-1 agreement and KL)"
        ]
    skipped = skipped_legs(manifest)
    if kv_cache_dtype(manifest) != manifest["dtype"] and source["kind"] == "checkpoint":
        skipped.append(
            f"{kv_cache_dtype(manifest)} KV cache: no transformers leg (its float caches are "
            "not the artifact's)"
        )
    reason = verify_hf.unavailable_reason(manifest)
    if reason is None or source["kind"] == "zoo":
        return skipped
    return [*skipped, f"no transformers leg: {reason}"]


def _compare(name: str, outputs: dict, reference: dict, tolerance: float) -> list[Comparison]:
    import torch

    from attnexport.tolerances import scaled_tolerance

    comparisons = []
    for output, expected in reference.items():
        if output not in outputs:
            continue  # the transformers leg has no paged caches
        actual = outputs[output].to(torch.float64)
        expected = expected.to(torch.float64)
        diff = (actual - expected).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        scale = float(expected.abs().max().clamp_min(1e-12)) if expected.numel() else 1e-12
        bound = scaled_tolerance(tolerance, scale)
        comparisons.append(Comparison(name, output, max_abs, max_abs / scale, bound))
    return comparisons


def _compare_quantized(
    name: str, outputs: dict, reference: dict, weights: dict, following: dict
) -> list[Comparison]:
    """A leg on quantized weights against the float reference: every logits row of the batch
    at once by :func:`attnexport.tolerances.logit_quality` (max abs error, top-1 agreement, KL,
    perplexity increase of the batch's next tokens, confident flips) against
    :func:`attnexport.tolerances.quantized_bounds`; the caches by max abs error against the
    format's cache bound."""
    import torch

    from attnexport.tolerances import logit_quality, quantized_bounds

    bounds = quantized_bounds(weights["format"])
    comparisons = []
    rows = [o for o in reference if o.endswith("logits") and o in outputs]
    for output in reference:
        if output in outputs and not output.endswith("logits"):
            comparisons += _compare(
                name, {output: outputs[output]}, {output: reference[output]}, bounds["cache"]
            )
    if not rows:
        return comparisons
    actual = torch.cat([outputs[o] for o in rows])
    expected = torch.cat([reference[o] for o in rows])
    targets = [t for o in rows for t in following[o]]
    quality = logit_quality(actual, expected, targets=targets)
    scale = float(expected.abs().max().clamp_min(1e-12))
    checked = {k: bounds[k] for k in ("kl", "ppl_increase", "confident_flips")}
    comparisons.insert(
        0,
        Comparison(
            name,
            f"logits ({actual.shape[0]} rows)",
            quality["max_abs"],
            quality["max_abs"] / scale,
            0.0,
            quality=quality,
            bounds=checked,
        ),
    )
    return comparisons


def _transformers_leg(
    manifest: dict, artifact: Path, batch: Batch, reference: dict, tolerance: float, trust: bool
) -> list[Comparison]:
    """The checkpoint in transformers: its logits on the batch against the reference, and its
    greedy tokens against the engine's on the artifact (a count of differing tokens, which
    must be 0)."""
    from attnexport.cli import verify_hf

    model = verify_hf.load_hf_model(manifest)
    prompts, decode_tokens = batch
    outputs = verify_hf.teacher_forced_logits(model, manifest, prompts, decode_tokens)
    comparisons = _compare("transformers", outputs, reference, tolerance)
    if manifest["kind"] == "decoder":
        wrong, total = verify_hf.greedy_mismatches(model, manifest, artifact, prompts, trust)
        comparisons.append(
            Comparison(
                "transformers",
                f"greedy tokens differing ({verify_hf.GREEDY_TOKENS}/prompt)",
                float(wrong),
                wrong / max(total, 1),
                0.0,
            )
        )
    return comparisons


def verify_artifact(
    artifact: Path, seed: int = 0, step=lambda _: None, *, trust_pickle: bool = False
) -> tuple[str, list[Comparison]]:
    """Runs every leg; returns the reference leg's name and each output's comparison with it
    (the reference is ``eager[sdpa]``, or ``pt2`` when the checkpoint is gone)."""
    require("torch", "export", "attnexport verify (it rebuilds the eager model)")
    from attnexport.artifact import DTYPES, rebuild_eager_model
    from attnexport.tolerances import kv_cache_model_tolerance, model_tolerance

    manifest = read_manifest(artifact)
    if manifest is None:
        raise CliError(
            f"ARTIFACT: {artifact} has no manifest.json; verify needs an export "
            "directory made by `attnexport export`"
        )
    directory = artifact_dir(artifact)
    step("rebuilding the eager model")
    model = rebuild_eager_model(manifest)
    legs = _legs(manifest, directory, model, trust_pickle)
    if len(legs) < 2:
        raise CliError(f"ARTIFACT: only {list(legs)} can run here; nothing to compare")
    run_leg = _run_encoder if manifest["kind"] == "encoder" else _run_paged
    batch = _batch(manifest, seed, directory) if manifest["kind"] != "encoder" else ([], [])
    tolerance = model_tolerance(DTYPES[manifest["dtype"]])
    cache_dtype, other_caches = _cache_dtypes(manifest)
    if other_caches:  # the legs share the cache dtype; rounding may move a cache value
        import torch

        tolerance = max(tolerance, kv_cache_model_tolerance(getattr(torch, cache_dtype)))
    reference_name, *others = legs
    step(f"running {reference_name}")
    reference = run_leg(legs[reference_name](), manifest, batch, seed)
    comparisons = []
    weights = manifest.get("weights")
    following = next_tokens(manifest, batch)
    for name in others:
        step(f"running {name}")
        outputs = run_leg(legs[name](), manifest, batch, seed)
        if weights is not None and name.startswith("onnx"):
            comparisons += _compare_quantized(name, outputs, reference, weights, following)
        else:
            comparisons += _compare(name, outputs, reference, tolerance)
    del legs, model  # the transformers leg loads a model of its own
    gc.collect()
    from attnexport.cli import verify_hf

    # A quantized artifact's greedy tokens are not the float checkpoint's: its quality is the
    # comparison above, against the float eager model.
    if weights is None and not other_caches and verify_hf.unavailable_reason(manifest) is None:
        step("running transformers")
        comparisons += _transformers_leg(
            manifest, artifact, batch, reference, tolerance, trust_pickle
        )
    return reference_name, comparisons


def run(args: argparse.Namespace) -> int:
    with steps(quiet=args.json) as step:
        reference, comparisons = verify_artifact(
            args.artifact, args.seed, step, trust_pickle=args.trust_remote_pickle
        )
    messages = notes(read_manifest(args.artifact))
    ok = all(c.ok for c in comparisons)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "reference": reference,
                    "notes": messages,
                    "comparisons": [c.to_json() for c in comparisons],
                }
            )
        )
        return 0 if ok else 1
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    for message in messages:
        console.print(f"[yellow]note:[/] {escape(message)}")
    exact = [c for c in comparisons if c.quality is None]
    quantized = [c for c in comparisons if c.quality is not None]
    if exact:
        console.print(_exact_table(exact, args.artifact, reference))
    if quantized:
        console.print(_quality_table(quantized, reference))
    console.print(
        "[green]all outputs within tolerance[/]"
        if ok
        else "[red]some outputs exceed the tolerance[/]"
    )
    return 0 if ok else 1


def _verdict(c: Comparison) -> str:
    return "[green]ok[/]" if c.ok else "[red]FAIL[/]"


def _exact_table(comparisons: list[Comparison], artifact: Path, reference: str):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"verify {artifact} (reference: {reference})"))
    for column in ("leg", "output", "max abs err", "max rel err", "tolerance", ""):
        table.add_column(column, justify="left" if column in ("leg", "output") else "right")
    for c in comparisons:
        table.add_row(
            escape(c.leg),  # "onnx[native]" is not markup
            escape(c.output),
            f"{c.max_abs:.2e}",
            f"{c.max_rel:.2e}",
            f"{c.tolerance:.0e}" if c.tolerance else "0",
            _verdict(c),
        )
    return table


def _quality_table(comparisons: list[Comparison], reference: str):
    """The quantized legs: what quantization costs against the float reference (logit error,
    top-1 agreement, KL, perplexity increase, confident flips); the bounds in the caption."""
    from rich.markup import escape
    from rich.table import Table

    bounds = comparisons[0].bounds
    table = Table(
        title=escape(f"quantized weights against the float model ({reference})"),
        caption=f"bounds: KL <= {bounds['kl']:.2g}, ppl Δ <= +{100 * bounds['ppl_increase']:.0f}%,"
        f" flips (of confident tokens) <= {100 * bounds['confident_flips']:.0f}%",
    )
    for column in ("leg", "output", "logit err", "top-1", "KL", "ppl Δ", "flips", ""):
        table.add_column(column, justify="left" if column in ("leg", "output") else "right")
    for c in comparisons:
        q = c.quality
        table.add_row(
            escape(c.leg),
            escape(c.output),
            f"{q['max_abs']:.2f}",
            f"{q['top1_agreement']:.3f}",
            f"{q['kl']:.2e}",
            f"{100 * q['ppl_increase']:+.2f}%",
            f"{100 * q['confident_flips']:.1f}%",
            _verdict(c),
        )
    return table

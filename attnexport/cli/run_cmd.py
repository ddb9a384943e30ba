"""``attnexport run ARTIFACT``: generate from prompts with the paged engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnexport.artifact import read_manifest
from attnexport.cli.errors import CliError, add_trust_flag
from attnexport.errors import require


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "run",
        help="generate tokens from an export directory or model file",
        description="Run ARTIFACT (an export directory, model.onnx or model.pt2) on one or "
        "more prompts with continuous batching over a paged KV cache. Greedy by default.",
    )
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT")
    parser.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeat for more requests)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt, tokenized with the artifact's tokenizer (repeatable)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, metavar="N")
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy"
    )
    parser.add_argument("--top-k", type=int, default=0, metavar="K")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument(
        "--stop-token-ids",
        default=None,
        metavar="IDS",
        help="comma-separated stop tokens (default: the checkpoint's eos_token_id; '' for none)",
    )
    for flag, what in (
        ("--forced-bos-token-id", "the first generated token"),
        ("--forced-eos-token-id", "the last token at --max-tokens / the maximum length"),
    ):
        parser.add_argument(
            flag,
            default=None,
            metavar="ID",
            help=f"force {what} (default: the checkpoint's generation config; 'none' for none)",
        )
    parser.add_argument(
        "--decoder-start-token-id",
        type=int,
        default=None,
        metavar="ID",
        help="encoder-decoder models: the decoder's first token (default: the checkpoint's)",
    )
    parser.add_argument(
        "--executor",
        choices=("auto", "ort", "torch"),
        default="auto",
        help="onnxruntime (default when model.onnx exists) or torch (.pt2)",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "sdpa", "ipex", "xformers"),
        default="auto",
        help="attention backend of the torch executor",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_trust_flag(parser)
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.set_defaults(run=run)


def parse_ids(text: str, what: str) -> list[int]:
    """``"1, 2,3"`` -> ``[1, 2, 3]``; CliError naming ``what`` otherwise."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(
            f"{what}: expected comma-separated integers like 1,2,3, got {text!r}"
        ) from None


def optional_token(text: str | None, default: int | None, what: str) -> int | None:
    """A token flag: ``default`` when not given, None for ``none``, else the id."""
    if text is None:
        return default
    if text.strip().lower() in ("none", ""):
        return None
    ids = parse_ids(text, what)
    if len(ids) != 1:
        raise CliError(f"{what}: expected one token id or 'none', got {text!r}")
    return ids[0]


def load_tokenizer(artifact: Path, manifest: dict | None):
    """The tokenizer saved in the export directory; CliError if there is none."""
    directory = artifact if artifact.is_dir() else artifact.parent
    files = (manifest or {}).get("tokenizer_files") or []
    if "tokenizer.json" in files or (directory / "tokenizer.json").is_file():
        tokenizers = require("tokenizers", "hf", "--prompt TEXT (tokenizer.json)")
        return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    if files:
        transformers = require("transformers", "hf", "--prompt TEXT with this tokenizer")
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    raise CliError(
        f"--prompt: {directory} has no tokenizer; pass token ids with --prompt-ids, or export "
        "from a checkpoint directory that has tokenizer files"
    )


def _encode(tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text)
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def check_backend(name: str, executor: str) -> None:
    """Refuses, before loading anything, a backend that cannot run here."""
    if name == "auto":
        return
    import attnexport  # noqa: F401  (registers backends)
    from attnexport.custom_ops import get_backend

    reason = get_backend(name).unavailable_reason()
    if reason:
        raise CliError(f"--backend {name}: not available here: {reason}")


def _encoder_decoder(args: argparse.Namespace):
    """The flag's decoder start token; None when it is not given (``engine_from_path`` then
    takes the manifest's)."""
    from attnexport.runtime import EncoderDecoderConfig

    start = args.decoder_start_token_id
    if start is None:
        return None
    if start < 0:
        raise CliError(f"--decoder-start-token-id: expected a token id >= 0, got {start}")
    return EncoderDecoderConfig(start)


def run(args: argparse.Namespace) -> int:
    from attnexport.runtime import SamplingParams, engine_from_path

    if not args.prompt_ids and not args.prompt:
        raise CliError("no prompt: pass --prompt-ids 1,2,3 or --prompt TEXT (repeatable)")
    if not args.artifact.exists():
        raise CliError(
            f"ARTIFACT: {args.artifact} does not exist (create one with: "
            "attnexport export MODEL --out DIR)"
        )
    manifest = read_manifest(args.artifact)
    if manifest and manifest["kind"] == "encoder":
        raise CliError(
            f"ARTIFACT: {manifest['architecture']} is an encoder model; `run` generates with "
            "decoder and encoder-decoder models (use `attnexport verify` to check it)"
        )
    check_backend(args.backend, args.executor)
    tokenizer = load_tokenizer(args.artifact, manifest) if args.prompt else None
    prompts = [parse_ids(text, "--prompt-ids") for text in args.prompt_ids]
    prompts += [_encode(tokenizer, text) for text in args.prompt]
    generation = (manifest or {}).get("generation") or {}
    if args.stop_token_ids is None:
        stops = generation.get("eos_token_ids", [])
    else:
        stops = parse_ids(args.stop_token_ids, "--stop-token-ids")
    forced = {
        name: optional_token(getattr(args, name), generation.get(name), flag)
        for name, flag in (
            ("forced_bos_token_id", "--forced-bos-token-id"),
            ("forced_eos_token_id", "--forced-eos-token-id"),
        )
    }
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=tuple(stops),
        **forced,
    )
    params.check()  # a bad flag is a user error for every prompt
    engine = engine_from_path(
        args.artifact,
        executor=args.executor,
        backend=args.backend,
        device=args.device,
        encoder_decoder=_encoder_decoder(args),
        trust_pickle=args.trust_remote_pickle,
    )
    outputs = engine.generate(prompts, params)
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise CliError(f"prompt {next(i for i, o in enumerate(outputs) if o.error)}: {errors[0]}")
    if args.json:
        print(
            json.dumps(
                {
                    "outputs": [
                        {
                            "token_ids": list(o.outputs[0].token_ids),
                            "finish_reason": o.outputs[0].finish_reason,
                        }
                        for o in outputs
                    ]
                }
            )
        )
        return 0
    from rich.console import Console

    console = Console()
    for i, output in enumerate(outputs):
        sample = output.outputs[0]
        console.print(
            f"[bold]prompt {i}[/] ({len(output.prompt_token_ids)} tokens) -> "
            f"{len(sample.token_ids)} tokens, finish: {sample.finish_reason}"
        )
        console.print(f"  ids: {list(sample.token_ids)}")
        if tokenizer is not None:
            console.print(f"  text: {_decode(tokenizer, list(sample.token_ids))!r}")
    return 0

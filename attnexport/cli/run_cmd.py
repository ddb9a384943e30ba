"""``attnexport run ARTIFACT``: generate from prompts with the paged engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from attnexport.artifact import artifact_dir, read_manifest
from attnexport.cli.errors import CliError
from attnexport.cli.flags import add_engine_flags, kv_cache_bytes
from attnexport.cli.prompts import PromptSpec, chat_messages, read_prompts_file


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
    parser.add_argument(
        "--chat",
        action="append",
        default=[],
        metavar="MESSAGE",
        help="a user message, sent through the tokenizer's chat template with the assistant "
        "prompt appended (repeatable: one conversation per message)",
    )
    parser.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message put before every --chat message",
    )
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        metavar="FILE",
        help='one JSON object per line: {"prompt": TEXT} or {"messages": [...]}, with '
        "optional sampling fields (max_tokens, temperature, top_k, top_p, seed, n, ...)",
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
    add_engine_flags(
        parser,
        "what the requests need: each sample's prompt + --max-tokens tokens, at most a quarter "
        "of the memory",
    )
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


def load_tokenizer(artifact: Path, manifest: dict | None, required: bool = True):
    """The tokenizer saved in the export directory, exactly as transformers.AutoTokenizer
    loads it. Without one (or without transformers) that is a CliError when text prompts
    need it (``required``), else None: the outputs then have no text."""
    from attnexport.runtime.loading import artifact_tokenizer

    directory = artifact_dir(artifact)
    try:
        tokenizer = artifact_tokenizer(directory, manifest)
    except ModuleNotFoundError:
        if required:
            raise
        return None
    if tokenizer is not None or not required:
        return tokenizer
    raise CliError(
        f"text prompts (--prompt, --chat, --prompts-file): {directory} has no tokenizer; pass "
        "token ids with --prompt-ids, or export from a checkpoint directory that has tokenizer "
        "files"
    )


def collect_prompts(args: argparse.Namespace) -> list[PromptSpec]:
    """Every request of the command line, in the order --prompt-ids, --prompt, --chat,
    --prompts-file."""
    specs = [
        PromptSpec(f"--prompt-ids {i}", ids=parse_ids(text, "--prompt-ids"))
        for i, text in enumerate(args.prompt_ids)
    ]
    specs += [PromptSpec(f"--prompt {i}", text=text) for i, text in enumerate(args.prompt)]
    specs += [
        PromptSpec(f"--chat {i}", messages=chat_messages(text, args.system))
        for i, text in enumerate(args.chat)
    ]
    if args.system is not None and not args.chat:
        raise CliError("--system: applies to --chat messages; pass --chat MESSAGE too")
    if args.prompts_file is not None:
        specs += read_prompts_file(args.prompts_file)
    if not specs:
        raise CliError(
            "no prompt: pass --prompt-ids 1,2,3, --prompt TEXT, --chat MESSAGE (repeatable) "
            "or --prompts-file FILE"
        )
    return specs


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
    from attnexport.runtime import CacheConfig, SamplingParams, engine_from_path

    memory_bytes = kv_cache_bytes(args)
    specs = collect_prompts(args)
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
    needs_text = any(spec.ids is None for spec in specs)
    tokenizer = load_tokenizer(args.artifact, manifest, required=needs_text)
    prompts = [spec.token_ids(tokenizer) for spec in specs]
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
    params_list = [dataclasses.replace(params, **spec.sampling) for spec in specs]
    for i, request_params in enumerate(params_list):
        try:
            request_params.check()
        except (TypeError, ValueError) as error:
            raise CliError(f"prompt {i} ({specs[i].where}): {error}") from None
    # The pool holds what these requests need at once, not a server's worst case; an
    # explicit --kv-cache-memory wins. (Upper bounds: forks share their prompt's blocks.)
    lengths = [
        len(prompt) + request_params.max_tokens
        for prompt, request_params in zip(prompts, params_list, strict=True)
        for _ in range(request_params.n)
    ]
    engine = engine_from_path(
        args.artifact,
        cache_config=CacheConfig(memory_bytes=memory_bytes, sequence_tokens=lengths),
        executor=args.executor,
        backend=args.backend,
        device=args.device,
        encoder_decoder=_encoder_decoder(args),
        trust_pickle=args.trust_remote_pickle,
        tokenizer=tokenizer,
    )
    for i, (prompt, request_params) in enumerate(zip(prompts, params_list, strict=True)):
        try:  # every request is checked before any runs
            engine.check_request(prompt, request_params)
        except (TypeError, ValueError) as error:
            raise CliError(f"prompt {i} ({specs[i].where}): {error}") from None
    # One request with text streams it as it is generated; several (or --json) are printed
    # when all are done, in prompt order.
    streamed = not args.json and tokenizer is not None and len(prompts) == 1
    streamed = streamed and params_list[0].n == 1
    if streamed:
        outputs = [stream_text(engine.stream(prompts, params_list))]
    else:
        outputs = engine.generate(prompts, params_list)
    _raise_first_error(outputs)
    if args.json:
        print(json.dumps({"outputs": [output_json(o) for o in outputs]}))
    else:
        show_outputs(outputs, streamed)
    return 0


def _raise_first_error(outputs) -> None:
    for i, output in enumerate(outputs):
        if output.error:
            raise CliError(f"prompt {i}: {output.error}")


def output_json(output) -> dict:
    """One request of ``run --json``: sample 0's ``token_ids``, ``finish_reason`` and ``text``
    (null without a tokenizer), the ``prompt_token_ids``, and with n > 1 every sample under
    ``samples``."""
    sample = output.outputs[0]
    entry = {
        "token_ids": list(sample.token_ids),
        "finish_reason": sample.finish_reason,
        "prompt_token_ids": list(output.prompt_token_ids),
        "text": sample.text,
    }
    if len(output.outputs) > 1:
        entry["samples"] = [
            {
                "index": s.index,
                "token_ids": list(s.token_ids),
                "finish_reason": s.finish_reason,
                "text": s.text,
            }
            for s in output.outputs
        ]
    return entry


def stream_text(updates):
    """Writes the text of a single request to stdout as it is generated; returns its final
    output. Plain writes: model text is never read as markup."""
    last = None
    for last in updates:
        if last.error:
            raise CliError(f"prompt 0: {last.error}")
        sys.stdout.write(last.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return last


def show_outputs(outputs, streamed: bool) -> None:
    """Human output, in prompt order: per sample its token counts, finish reason, ids and
    text (unless it was streamed). Model text is printed with markup off (a model may well
    generate ``[/INST]``)."""
    from rich.console import Console

    console = Console(highlight=False, emoji=False)
    for i, output in enumerate(outputs):
        for sample in output.outputs:
            label = f"prompt {i}" + (f" sample {sample.index}" if len(output.outputs) > 1 else "")
            console.print(
                f"[bold]{label}[/] ({len(output.prompt_token_ids)} tokens) -> "
                f"{len(sample.token_ids)} tokens, finish: {sample.finish_reason}"
            )
            console.print(f"  ids: {list(sample.token_ids)}", markup=False)
            if sample.text is not None and not streamed:
                console.print(f"  text: {sample.text!r}", markup=False)

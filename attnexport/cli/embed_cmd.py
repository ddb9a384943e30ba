"""``attnexport embed ARTIFACT --text ...``: sentence embeddings of an exported encoder (BERT),
pooled and normalised as the checkpoint's sentence-transformers configuration says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnexport.cli.errors import CliError
from attnexport.cli.flags import add_executor_flag, add_trust_flag
from attnexport.cli.run_cmd import parse_ids


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "embed",
        help="sentence embeddings of an exported encoder model",
        description="Embed texts (or token-id sequences) with ARTIFACT, an export directory of "
        "an encoder model (bert): packed variable-length batches, then the pooling (mean or "
        "CLS) and L2 normalisation its sentence-transformers config asks for (recorded in the "
        "manifest at export). Texts are tokenized with the artifact's tokenizer and truncated "
        "to its max_seq_length, as sentence-transformers does.",
    )
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT")
    parser.add_argument(
        "--text", action="append", default=[], metavar="TEXT", help="a text (repeatable)"
    )
    parser.add_argument(
        "--ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a sequence as comma-separated token ids, special tokens included (repeatable)",
    )
    add_executor_flag(parser)
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="tokens per forward (sequences are packed without padding; default 8192)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_trust_flag(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnexport.runtime.embedding import EmbeddingEngine

    if not args.text and not args.ids:
        raise CliError("nothing to embed: give --text TEXT or --ids IDS (repeatable)")
    if args.text and args.ids:
        raise CliError("--text and --ids: give one kind of input per call")
    if not args.artifact.exists():
        raise CliError(
            f"ARTIFACT: {args.artifact} does not exist (create one with: "
            "attnexport export MODEL --out DIR)"
        )
    if args.max_batch_tokens < 1:
        raise CliError(f"--max-batch-tokens: expected a positive int, got {args.max_batch_tokens}")
    engine = EmbeddingEngine.from_path(
        args.artifact,
        executor=args.executor,
        max_num_batched_tokens=args.max_batch_tokens,
        trust_pickle=args.trust_remote_pickle,
    )
    if args.text:
        vectors = engine.embed_texts(args.text)
        inputs = [{"text": t} for t in args.text]
    else:
        sequences = [parse_ids(ids, "--ids") for ids in args.ids]
        vectors = engine.embed(sequences)
        inputs = [{"token_ids": s} for s in sequences]
    config = engine.config
    if args.json:
        result = {
            "pooling": config.pooling,
            "normalize": config.normalize,
            "dimension": int(vectors.shape[1]),
            "embeddings": [
                {**entry, "embedding": [float(v) for v in vector]}
                for entry, vector in zip(inputs, vectors, strict=True)
            ],
        }
        print(json.dumps(result))
        return 0
    norm = "L2-normalised" if config.normalize else "not normalised"
    count, dimension = vectors.shape
    print(f"{count} embeddings of dimension {dimension} ({config.pooling} pooling, {norm})")
    for entry, vector in zip(inputs, vectors, strict=True):
        label = entry.get("text", entry.get("token_ids"))
        head = ", ".join(f"{v:.4f}" for v in vector[:6])
        print(f"{label!s:.60}: [{head}, ...]")
    return 0

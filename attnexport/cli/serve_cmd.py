"""``attnexport serve ARTIFACT``: an OpenAI-compatible HTTP server over the paged engine."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from attnexport.cli.errors import CliError
from attnexport.cli.flags import add_engine_flags, kv_cache_bytes
from attnexport.cli.run_cmd import check_backend


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve an export over HTTP with OpenAI's API (continuous batching)",
        description="Serve ARTIFACT (an export directory, model.onnx or model.pt2) with "
        "OpenAI's completions, chat completions and models routes, /health and Prometheus "
        "/metrics. Requests share one engine: continuous batching over a paged KV cache. "
        "SIGTERM or Ctrl-C stops accepting connections, lets running requests finish for "
        "--shutdown-timeout seconds, then aborts the rest.",
    )
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model id of /v1/models and responses (default: the export directory's name)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        metavar="N",
        help="sequences running at once (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens per engine step (default: 2048, or a LongRoPE model's switch length + 1)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="longest sequence, prompt and output (default: the model's)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        metavar="N",
        help="requests that may wait for a slot; more get HTTP 503, and a request with more "
        "prompts than this a 400 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="the largest request body; larger ones get HTTP 413 (default: 4 MiB, or 32 bytes "
        "per token of --max-model-len when that is more)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds running requests get to finish after SIGTERM; the rest then get an "
        "HTTP 503, or an error event and [DONE] on a stream (default: %(default)s)",
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template replacing the artifact's (e.g. one that renders tools)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        help="how the model writes tool calls (default: what its chat template asks for)",
    )
    add_engine_flags(
        parser,
        "--max-num-seqs sequences of the maximum length, at most a quarter of the memory, "
        "committed at start-up",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        metavar="N",
        help="onnxruntime intra-op threads (default: OMP_NUM_THREADS, else the cores)",
    )
    parser.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnexport.errors import require

    require("uvicorn", "serve", "attnexport serve")
    require("fastapi", "serve", "attnexport serve")
    from attnexport.serve.app import create_app
    from attnexport.serve.http_server import DrainingServer
    from attnexport.serve.served_model import load_served_model

    for flag, value, minimum in (
        ("--port", args.port, 0),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
        ("--max-model-len", args.max_model_len, 1),
        ("--max-queued-requests", args.max_queued_requests, 1),
        ("--max-request-bytes", args.max_request_bytes, 1),
    ):
        if value is not None and value < minimum:
            raise CliError(f"{flag}: expected an integer >= {minimum}, got {value}")
    if args.port > 65535:
        raise CliError(f"--port: expected a port in [0, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout: expected seconds >= 0, got {args.shutdown_timeout}")
    check_backend(args.backend, args.executor)
    options = {"num_threads": args.num_threads} if args.num_threads else {}
    template = None
    if args.chat_template is not None:
        if not args.chat_template.is_file():
            raise CliError(f"--chat-template: no such file: {args.chat_template}")
        template = args.chat_template.read_text(encoding="utf-8")
    model = load_served_model(
        args.artifact,
        name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=kv_cache_bytes(args),
        executor=args.executor,
        backend=args.backend,
        device=args.device,
        trust_pickle=args.trust_remote_pickle,
        chat_template=template,
        tool_call_format=args.tool_call_parser,
        **options,
    )
    if args.log_level in ("info", "debug"):
        # The pool's size, the first thing to check when memory runs short (its pages are
        # committed as they are used, so the process grows up to it under load).
        print(f"attnexport serve: {model.engine.describe()}", file=sys.stderr, flush=True)
    app = create_app(
        model,
        max_queued_requests=args.max_queued_requests,
        shutdown_timeout=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes,
    )
    server = DrainingServer(
        app,
        shutdown_timeout=args.shutdown_timeout,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C
        server.run()
    return 0 if server.started else 3  # uvicorn's exit status when it cannot bind

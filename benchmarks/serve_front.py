"""The HTTP front of ``benchmarks/serve.py``'s genai and transformers legs, run in that leg's
interpreter (``serve.py --front genai|transformers``): the same stack as ``attnexport serve``
(FastAPI + uvicorn, OpenAI-style streamed completions with token-id prompts) over one
generation per request, ``--workers`` at a time in a thread pool: the way users of
onnxruntime-genai (which has no server) or of transformers' ``generate`` serve them."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def main(args) -> None:
    """The HTTP front of the genai and transformers legs (runs in that leg's interpreter):
    ``/v1/completions`` with token-id prompts, streamed as OpenAI-style server-sent events, one
    generation per request on a pool of ``workers`` threads; ``/kv`` the bytes of cache the
    running requests hold."""
    generate, bytes_per_token = _generator(args.front, args)
    pool = ThreadPoolExecutor(max_workers=args.workers)
    held: dict[int, int] = {}  # request -> tokens of cache it holds
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/kv")
    async def kv() -> JSONResponse:
        with lock:
            return JSONResponse({"bytes": sum(held.values()) * bytes_per_token})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        prompt, new = body["prompt"], body["max_tokens"]
        tokens: queue.SimpleQueue = queue.SimpleQueue()
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        key = id(tokens)

        def on_token(token: int, cache_tokens: int) -> None:
            with lock:
                held[key] = cache_tokens
            tokens.put(token)
            loop.call_soon_threadsafe(ready.set)

        def work() -> None:
            try:
                generate(prompt, new, on_token)
            except Exception:  # the client sees a short answer; the log says why
                traceback.print_exc()
            finally:
                with lock:
                    held.pop(key, None)
                tokens.put(None)
                loop.call_soon_threadsafe(ready.set)

        pool.submit(work)

        async def events():
            while True:
                await ready.wait()
                ready.clear()
                batch = []
                while not tokens.empty():
                    batch.append(tokens.get())
                ids = [t for t in batch if t is not None]
                if ids:
                    chunk = {"choices": [{"index": 0, "text": "", "token_ids": ids}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if None in batch:
                    yield "data: [DONE]\n\n"
                    return

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def _generator(leg: str, args):
    """``generate(prompt, new, on_token)`` for the leg, and its cache bytes per token."""
    config = json.loads((args.work / "ckpt" / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * 4
    if leg == "genai":
        import numpy as np
        import onnxruntime_genai as og

        model = og.Model(str(args.work / "genai"))

        def generate(prompt, new, on_token):
            params = og.GeneratorParams(model)
            total = len(prompt) + new
            params.set_search_options(max_length=total, min_length=total, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(np.asarray([prompt], dtype=np.int32))
            while not generator.is_done():
                generator.generate_next_token()
                # its cache is allocated for max_length tokens from the start
                on_token(int(generator.get_next_tokens()[0]), total)

        return generate, per_token
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(args.threads)
    model = transformers.LlamaForCausalLM.from_pretrained(args.work / "ckpt").eval()

    class Streamer(BaseStreamer):
        def __init__(self, prompt_len: int, on_token) -> None:
            self.first, self.count, self.prompt_len, self.on_token = True, 0, prompt_len, on_token

        def put(self, value) -> None:
            if self.first:  # generate puts the prompt first
                self.first = False
                return
            self.count += 1
            self.on_token(int(value.reshape(-1)[0]), self.prompt_len + self.count)

        def end(self) -> None:
            pass

    def generate(prompt, new, on_token):
        with torch.no_grad():
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=2,
                streamer=Streamer(len(prompt), on_token),
            )

    return generate, per_token

"""One timed greedy generation of a CPU peer, run in that peer's own environment by
``benchmarks/peers.py`` (``run_leg``): reads a JSON request on stdin, prints a JSON result.

The request: ``peer``, ``format``, ``model`` (a GGUF file, a model directory or the
checkpoint), ``threads``, ``prompts`` (token id lists, all of one length), ``warmup_prompts``
(other prompts of the same shape: a warm-up generation of 4 tokens first, so that no leg times
its first allocation or compilation), ``new_tokens``. Every sequence generates exactly
``new_tokens`` tokens (end-of-sequence ignored). The result: ``ttft_s`` (from submitting the
batch until every sequence has its first token), ``decode_tok_s`` (the tokens generated from
there to the last token, over that time: batch x (new_tokens - 1) unless the engine decoded
some sequences before the last one's first token, ``rates``), ``peak_rss_mb`` (this process,
model included), ``describe`` and ``first_tokens`` (the first sequence's tokens, a sanity check).

Imports only the standard library at top level: it runs in every peer's interpreter.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def rates(
    batch: int, new: int, start: float, first: float, end: float, at_first: int | None = None
) -> dict:
    """The result's times; ``at_first``: the tokens the batch had when its last sequence got
    its first (an engine that decodes some sequences while others still prefill, as
    OpenVINO's and vLLM's schedulers do at long prompts, has more than ``batch``): only the
    tokens after it count, so that its decode rate is not inflated by the earlier ones
    (OpenVINO fp32, prompt 1024, batch 32: 1178 tokens/s counted from the whole batch)."""
    decoded = batch * new - (batch if at_first is None else at_first)
    return {
        "ttft_s": first - start,
        "decode_tok_s": decoded / (end - first),
        "tokens_at_first_token": batch if at_first is None else at_first,
    }


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


# ----------------------------------------------------------------------------- llama.cpp


def leg_llamacpp(request: dict) -> dict:
    """llama.cpp's C API through llama-cpp-python's ctypes bindings: one context with a KV
    sequence per prompt (its default, non-unified cache: a stream per sequence), the prompts
    prefilled through ``llama_batch``es of ``n_batch`` tokens (logits of each prompt's last
    token only), then one ``llama_batch`` of one token per sequence per step; greedy argmax in
    NumPy over the logits rows llama.cpp returns."""

    import llama_cpp as lc
    import numpy as np

    threads, prompts, new = request["threads"], request["prompts"], request["new_tokens"]
    batch_size, length = len(prompts), len(prompts[0])
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(
        request["model"].encode(), lc.llama_model_default_params()
    )
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {request['model']}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    per_sequence = -(-(length + new) // 256) * 256
    params.n_ctx = batch_size * per_sequence
    params.n_seq_max = batch_size
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp cannot create the context")
    n_batch = max(lc.llama_n_batch(ctx), batch_size)
    batch = lc.llama_batch_init(n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, seq, logits
        batch.n_tokens = len(entries)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits_rows(rows: int):
        pointer = lc.llama_get_logits(ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, n_vocab))

    def run(prompts: list[list[int]], new: int) -> dict:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        entries = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        last = []
        for begin in range(0, len(entries), n_batch):
            chunk = entries[begin : begin + n_batch]
            decode(chunk)
            outputs = sum(e[3] for e in chunk)
            if outputs:
                last.extend(logits_rows(outputs).argmax(axis=1).tolist())
        first = time.perf_counter()
        generated = [[t] for t in last]
        for step in range(new - 1):
            decode([(g[-1], length + step, seq, True) for seq, g in enumerate(generated)])
            tokens = logits_rows(len(generated)).argmax(axis=1).tolist()
            for g, token in zip(generated, tokens, strict=True):
                g.append(token)
        end = time.perf_counter()
        return {**rates(len(prompts), new, start, first, end), "first_tokens": generated[0]}

    run(request["warmup_prompts"], 4)
    result = run(prompts, new)
    kv = {1: "f16", 0: "f32", 8: "q8_0"}.get(params.type_k, str(params.type_k))
    return result | {"describe": f"llama.cpp (llama-cpp-python {lc.__version__}), KV cache {kv}"}


# ----------------------------------------------------------------------------- OpenVINO


def leg_openvino(request: dict) -> dict:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` (its serving engine: paged KV cache,
    dynamic split-fuse prefill), one request per prompt, stepped here so the first token of
    every request is timed. Its scheduler's defaults, but for the cache size, a token budget
    that takes the whole batch's prompts in one step (as ours) and no prefix caching (the
    warm-up's prompts differ anyway)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ovg

    threads, prompts, new = request["threads"], request["prompts"], request["new_tokens"]
    scheduler = ovg.SchedulerConfig()
    scheduler.cache_size = 4  # GB
    scheduler.max_num_seqs = max(len(prompts), scheduler.max_num_seqs)
    # Every prompt in one step, as our engine's leg is set (its default budget, 256 tokens a
    # step, prefills a batch in chunks and decodes the first sequences meanwhile: at prompt
    # 1024, batch 32, 893 of 1024 tokens were out when the last sequence got its first).
    scheduler.max_num_batched_tokens = max(
        scheduler.max_num_batched_tokens, len(prompts) * len(prompts[0])
    )
    scheduler.enable_prefix_caching = False
    properties = {"INFERENCE_NUM_THREADS": threads}
    if request["format"] == "fp32":
        # Its CPU plugin computes in bfloat16 by default where the CPU has AVX512_BF16 or AMX
        # (an "fp32" model would run at half the precision there): the fp32 class is float32.
        properties["INFERENCE_PRECISION_HINT"] = "f32"
    pipe = ovg.ContinuousBatchingPipeline(request["model"], scheduler, "CPU", properties)

    def run(prompts: list[list[int]], new: int) -> dict:
        config = ovg.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new
        config.ignore_eos = True
        config.do_sample = False
        start = time.perf_counter()
        handles = [
            pipe.add_request(i, ov.Tensor(np.asarray([p], dtype=np.int64)), config)
            for i, p in enumerate(prompts)
        ]
        tokens: list[list[int]] = [[] for _ in prompts]
        first, at_first = None, 0
        while pipe.has_non_finished_requests():
            pipe.step()
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for output in handle.read().values():
                        tokens[i].extend(output.generated_ids)
            if first is None and all(tokens):
                first, at_first = time.perf_counter(), sum(map(len, tokens))
        end = time.perf_counter()
        for i, handle in enumerate(handles):
            if handle.can_read():
                for output in handle.read().values():
                    tokens[i].extend(output.generated_ids)
        if any(len(t) != new for t in tokens):
            raise RuntimeError(f"OpenVINO: expected {new} tokens, got {[len(t) for t in tokens]}")
        return {
            **rates(len(prompts), new, start, first, end, at_first),
            "first_tokens": tokens[0],
        }

    run(request["warmup_prompts"], 4)
    result = run(prompts, new)
    core = ov.Core()
    kv = core.get_property("CPU", "KV_CACHE_PRECISION")
    compute = properties.get("INFERENCE_PRECISION_HINT") or core.get_property(
        "CPU", "INFERENCE_PRECISION_HINT"
    )
    return result | {
        "describe": f"OpenVINO GenAI {ovg.__version__}, KV cache {kv}, compute {compute}"
    }


# ----------------------------------------------------------------------------- vLLM


def leg_vllm(request: dict) -> dict:
    """vLLM's CPU engine (``LLMEngine``, in this process), float32, no prefix caching; its
    other settings are its defaults (chunked prefill, its CPU attention backend, torch.compile).
    Stepped here so the first token of every request is timed."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, new = request["prompts"], request["new_tokens"]
    llm = vllm.LLM(
        model=request["model"],
        dtype="float32",
        max_model_len=len(prompts[0]) + new,
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=max(len(prompts) * len(prompts[0]), 2048),  # as OpenVINO's
        enable_prefix_caching=False,
        seed=0,
    )
    engine = llm.llm_engine

    def run(prompts: list[list[int]], new: int, tag: str) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=p), params)
        tokens: dict[str, list[int]] = {}
        first, at_first = None, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] = list(output.outputs[0].token_ids)
            if first is None and len(tokens) == len(prompts) and all(tokens.values()):
                first, at_first = time.perf_counter(), sum(map(len, tokens.values()))
        end = time.perf_counter()
        counts = [len(tokens.get(f"{tag}{i}", ())) for i in range(len(prompts))]
        if any(c != new for c in counts):
            raise RuntimeError(f"vLLM: expected {new} tokens, got {counts}")
        return {
            **rates(len(prompts), new, start, first, end, at_first),
            "first_tokens": tokens[f"{tag}0"],
        }

    run(request["warmup_prompts"], 4, "warmup")
    result = run(prompts, new, "timed")
    return result | {"describe": f"vLLM CPU {vllm.__version__}"}


# ----------------------------------------------------------------------------- onnxruntime-genai


def leg_genai(request: dict) -> dict:
    """onnxruntime-genai's generator on a batch: the prompts appended at once (its prefill),
    then ``generate_next_token`` until done."""
    import numpy as np
    import onnxruntime_genai as og

    prompts, new = request["prompts"], request["new_tokens"]
    model = og.Model(request["model"])

    def run(prompts: list[list[int]], new: int) -> dict:
        params = og.GeneratorParams(model)
        total = len(prompts[0]) + new
        params.set_search_options(
            max_length=total, min_length=total, do_sample=False, batch_size=len(prompts)
        )
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray(prompts, dtype=np.int32))
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        end = time.perf_counter()
        tokens = np.asarray(generator.get_sequence(0))[len(prompts[0]) :].tolist()
        return {**rates(len(prompts), new, start, first, end), "first_tokens": tokens}

    run(request["warmup_prompts"], 4)
    result = run(prompts, new)
    return result | {"describe": f"onnxruntime-genai {og.__version__}"}


LEGS = {
    "llamacpp": leg_llamacpp,
    "openvino": leg_openvino,
    "vllm": leg_vllm,
    "genai": leg_genai,
}


def main() -> int:
    request = json.load(sys.stdin)
    result = LEGS[request["peer"]](request)
    print(json.dumps(result | {"peak_rss_mb": peak_rss_mb()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

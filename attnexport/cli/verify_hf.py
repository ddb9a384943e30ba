"""The ``transformers`` leg of ``attnexport verify``: the source checkpoint run by transformers
itself, on the same teacher-forced batch as the other legs (logits), plus greedy generation
compared token for token with the exported model run by the engine."""

from __future__ import annotations

from pathlib import Path

import torch

from attnexport.artifact import DTYPES
from attnexport.contained_files import check_entries

GREEDY_TOKENS = 8
"""New tokens per prompt of the greedy comparison."""


def unavailable_reason(manifest: dict) -> str | None:
    """Why there is no transformers leg for this artifact; None when there is one."""
    source = manifest["source"]
    if source["kind"] != "checkpoint":
        return "zoo model: there is no transformers model to compare with"
    if not Path(source["path"]).is_dir():
        return "the source checkpoint is gone"
    if manifest["kind"] == "encoder":
        return "encoder models have no transformers leg (compare the legs above)"
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        return 'transformers is not installed (pip install "attnexport[hf]" adds this leg)'
    return None


def load_hf_model(manifest: dict):
    """The checkpoint as transformers loads it, in the artifact's dtype, eval mode; none of its
    entries may be a link out of it (UnsafePathError)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # verify has its own progress lines
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if manifest["kind"] == "encoder-decoder"
        else transformers.AutoModelForCausalLM
    )
    source = manifest["source"]["path"]
    check_entries(source, hub_links=True)  # transformers opens the files itself
    return auto.from_pretrained(source, dtype=DTYPES[manifest["dtype"]]).eval()


def teacher_forced_logits(
    model, manifest: dict, prompts: list[list[int]], decode_tokens: list[list[int]]
) -> dict[str, torch.Tensor]:
    """The outputs of ``verify``'s paged legs (``prefill logits``, ``decode k logits``; no
    caches) computed by transformers from whole sequences.

    ``prompts[i]`` is sequence i's prompt (the encoder input of an encoder-decoder, whose
    decoder starts from the start token); ``decode_tokens[k][i]`` the token appended to
    sequence i before decode step k + 1.
    """
    prefill, decodes = [], [[] for _ in decode_tokens]
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            appended = [step[i] for step in decode_tokens]
            if manifest["kind"] == "encoder-decoder":
                start = manifest["generation"].get("decoder_start_token_id") or 0
                decoder = [start, *appended]
                logits = model(
                    input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([decoder])
                ).logits[0]
                first = 1  # the decoder's prefill is its start token
            else:
                logits = model(input_ids=torch.tensor([prompt + appended])).logits[0]
                first = len(prompt)
            prefill.append(logits[:first])
            for k in range(len(decode_tokens)):
                decodes[k].append(logits[first + k : first + k + 1])
    results = {"prefill logits": torch.cat(prefill)}
    for k, rows in enumerate(decodes):
        results[f"decode {k + 1} logits"] = torch.cat(rows)
    return results


def greedy_mismatches(
    model, manifest: dict, artifact: Path, prompts: list[list[int]], trust_pickle: bool
) -> tuple[int, int]:
    """(mismatching tokens, tokens compared) between transformers' greedy ``generate`` and the
    engine on the artifact, ``GREEDY_TOKENS`` new tokens per prompt with the checkpoint's EOS
    as stop token. A decoder-only comparison (encoder-decoders add forced tokens that
    ``tests/cli/test_cli_encoder_decoder.py`` covers)."""
    from attnexport.runtime import CacheConfig, SamplingParams, engine_from_path

    eos = manifest["generation"].get("eos_token_ids") or []
    # a pool for these prompts, not the default's max_num_seqs x max_model_len (~5 GB beside
    # the model for SmolLM2's 8192-token context: verify's peak)
    lengths = tuple(len(prompt) + GREEDY_TOKENS for prompt in prompts)
    engine = engine_from_path(
        artifact, trust_pickle=trust_pickle, cache_config=CacheConfig(sequence_tokens=lengths)
    )
    params = SamplingParams(max_tokens=GREEDY_TOKENS, stop_token_ids=tuple(eos))
    outputs = engine.generate(prompts, params)
    del engine  # its session and caches, before transformers generates
    mismatches = compared = 0
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs, strict=True):
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0,
            )[0, len(prompt) :].tolist()
            ours = list(output.outputs[0].token_ids)
            length = max(len(generated), len(ours))
            compared += length
            mismatches += sum(
                a != b
                for a, b in zip(
                    generated + [None] * (length - len(generated)),
                    ours + [None] * (length - len(ours)),
                    strict=True,
                )
            )
    return mismatches, compared

"""Packing a scheduled batch into the model inputs of its step: sequence i computes its next
``num_new_tokens[i]`` tokens, and samples when its last token is computed. An encoder-decoder
batch also carries the encoder tokens of the requests whose encoder runs in this step."""

from __future__ import annotations

from attnexport.paged_inputs import ScheduledSequence
from attnexport.runtime.model_input import ModelInput, StepSequence, pack_decoder_step, pack_step
from attnexport.runtime.scheduler import ScheduledBatch


def pack_decoder_batch(batch: ScheduledBatch, block_size: int) -> ModelInput:
    """The inputs of a decoder's step. A sequence whose request scores its prompt
    (``prompt_logprobs``) asks for the logits of every token of its chunk; only its last row
    samples, when the chunk ends the sequence."""
    starts, block_ids, token_ids, rows = [], [], [], []
    scoring = False
    for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
        starts.append(seq.num_computed)
        block_ids.append(seq.block_ids)
        token_ids.append(seq.token_ids)
        if seq.request.prompt_logprobs is not None and seq.request.scores_prompt:
            rows.append(count)
            scoring = True
        else:
            rows.append(int(seq.num_computed + count == len(seq.token_ids)))
    counts = batch.num_new_tokens
    samples = None
    if scoring:
        samples = [
            seq.num_computed + count == len(seq.token_ids)
            for seq, count in zip(batch.seqs, counts, strict=True)
        ]
    return pack_decoder_step(starts, counts, block_ids, token_ids, rows, block_size, samples)


def pack_encoder_decoder_batch(batch: ScheduledBatch, block_size: int) -> tuple[ModelInput, int]:
    """The inputs of an encoder-decoder's step, and the encoder tokens it runs: the first
    sequence of a request whose encoder has not run yet runs it."""
    entries = []
    encoding: set[int] = set()
    num_encoder_tokens = 0
    for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
        encoder = seq.request.encoder
        encode_now = encoder is not None and not encoder.encoded
        encode_now = encode_now and id(encoder) not in encoding
        if encode_now:
            encoding.add(id(encoder))
            num_encoder_tokens += encoder.num_tokens
        scheduled = ScheduledSequence(
            seq.num_computed,
            count,
            seq.block_ids,
            encoder_len=encoder.num_tokens if encoder else 0,
            encoder_block_ids=encoder.block_ids if encoder else (),
            encode_now=encode_now,
        )
        samples = seq.num_computed + count == len(seq.token_ids)
        entries.append(
            StepSequence(
                scheduled, seq.token_ids, int(samples), encoder.token_ids if encode_now else ()
            )
        )
    return pack_step(entries, block_size), num_encoder_tokens

"""The parity probe the transformers path runs before it exports anything: the model on the
paged ops against transformers' own eager attention, on two short sequences packed into one
batch, prefilled in chunks beside a decode. A model whose layers keep state outside attention
(recurrent or state-space layers), mix the tokens of one row (convolutions, token shifts), or
mask in a way the ops do not (prefix-bidirectional, chunked, ...) gives other logits, and is
refused instead of exported wrong."""

from __future__ import annotations

import torch

from attnexport.custom_ops import ScheduledSequence, build_attention_metadata
from attnexport.models.errors import UnsupportedModelError
from attnexport.tolerances import model_tolerance

BLOCK_SIZE = 4
MIN_LENGTHS = (9, 6)
"""Tokens of the two probe sequences (longer when a layer's window is short, so that the
probe crosses it)."""
MAX_LENGTH = 40
# (new tokens of sequence 0, of sequence 1) per step; the rest of sequence 0 comes after.
_STEPS = ((-3, -1), (2, 1))


def _lengths(model) -> tuple[int, int]:
    windows = [c.sliding_window for c in model.layer_calls if c.sliding_window > 0]
    longest = min(max([*(w + 4 for w in windows), MIN_LENGTHS[0]]), MAX_LENGTH)
    return longest, max(MIN_LENGTHS[1], longest - 3)


REFERENCE_ATTENTION = ("eager", "sdpa")
"""transformers' own attention implementations the probe compares with, in order: eager, and
SDPA where a model's eager path fails (DeepSeek-V3's MLA with fewer KV heads than heads
repeats its keys again in eager attention; its SDPA path, generate's default, runs)."""


@torch.no_grad()
def _transformers_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' own logits of one sequence, with its own attention
    (:data:`REFERENCE_ATTENTION`); UnsupportedModelError when none of them runs."""
    from attnexport.models.generic.attention import ATTENTION

    config = model.hf_model.config
    device = next(model.parameters()).device
    failures = []
    for implementation in REFERENCE_ATTENTION:
        config._attn_implementation = implementation
        try:
            out = model.hf_model(input_ids=torch.tensor([tokens], device=device), use_cache=False)
            return out.logits[0].float().cpu()
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            failures.append(f"{implementation}: {type(error).__name__}: {error}")
        finally:
            config._attn_implementation = ATTENTION
    raise UnsupportedModelError(
        f"{type(model.hf_model).__name__}: transformers' own attention does not run it, so the "
        f"parity probe has nothing to compare with ({'; '.join(failures)})"
    )


@torch.no_grad()
def _paged_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits of ``sequences`` through the paged forward: both prefilled in
    one step (sequence 0 only partly), then a chunk of sequence 0 beside a decode of sequence
    1, then the rest of sequence 0."""
    device = next(model.parameters()).device
    need = [-(-len(s) // BLOCK_SIZE) for s in sequences]
    num_blocks = sum(need) + 1
    free = list(range(num_blocks))
    blocks = [[free.pop() for _ in range(n)] for n in need]  # descending: not contiguous
    caches = model.cache_spec(BLOCK_SIZE).allocate(num_blocks, device)
    done = [0, 0]
    plan = [
        (len(sequences[0]) + _STEPS[0][0], len(sequences[1]) + _STEPS[0][1]),
        _STEPS[1],
    ]
    plan.append((len(sequences[0]) - sum(p[0] for p in plan), 0))
    collected: list[list[torch.Tensor]] = [[], []]
    for counts in plan:
        scheduled, ids, positions, owners = [], [], [], []
        for seq, count in enumerate(counts):
            if count <= 0:
                continue
            scheduled.append(ScheduledSequence(done[seq], count, blocks[seq]))
            ids += sequences[seq][done[seq] : done[seq] + count]
            positions += range(done[seq], done[seq] + count)
            owners += [seq] * count
            done[seq] += count
        metadata = build_attention_metadata(scheduled, BLOCK_SIZE, device)
        logits = model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            torch.arange(len(ids), device=device),
            caches,
        ).cpu()
        owner = torch.tensor(owners)
        for seq in (0, 1):
            collected[seq].append(logits[owner == seq])
    return [torch.cat(rows) for rows in collected]


def check_against_transformers(model) -> float:
    """Raises UnsupportedModelError unless the paged forward of ``model`` (a
    :class:`~attnexport.models.generic.model.TransformersDecoder`) gives transformers' logits
    within the model tolerance of its dtype (scaled by the logits' magnitude); returns the
    largest error."""
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, model.vocab_size, (n,), generator=generator).tolist()
        for n in _lengths(model)
    ]
    ours = _paged_logits(model, sequences)
    worst = 0.0
    for tokens, logits in zip(sequences, ours, strict=True):
        reference = _transformers_logits(model, tokens)
        scale = max(1.0, float(reference.abs().max()))
        worst = max(worst, float((logits - reference).abs().max()) / scale)
    bound = model_tolerance(model.dtype)
    if not worst <= bound:  # also NaN
        raise UnsupportedModelError(
            f"{type(model.hf_model).__name__}: on the paged attention ops its logits differ "
            f"from transformers' own (relative error {worst:.2e} > {bound:.0e} on two packed "
            "sequences prefilled in chunks beside a decode): its layers keep state outside "
            "attention (recurrent or state-space layers), mix the tokens of a row, or mask "
            "attention in a way the paged ops do not express"
        )
    return worst

"""A minimal step-by-step driver for paged models, for parity checks (tests, ``attnexport
verify``).

It keeps per-sequence token lists and block lists, allocates blocks from a shuffled free
list (so block tables are never contiguous), packs each step's inputs with the engine's
:func:`attnexport.runtime.model_input.pack_step` and calls a *runner*:
``runner(args: tuple, kv_caches: list) -> (logits, kv_caches)``. Eager modules and
``ExportedProgram.module()`` update the caches in place and return the same list; an ONNX
session returns the ``_out`` caches, which replace the old ones.

The real engine (scheduler, preemption, prefix caching) lives in ``attnexport.runtime``; this is
only enough to drive prefill, chunked prefill and decode steps of a few sequences.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from attnexport.model_interface import CacheSpec
from attnexport.paged_inputs import ScheduledSequence
from attnexport.runtime.model_input import StepSequence, pack_step
from attnexport.runtime.torch_inputs import StepTensors

Runner = Callable[[tuple, list], tuple[torch.Tensor, list]]


@dataclass
class _Sequence:
    tokens: list[int]
    num_cached: int = 0
    blocks: list[int] = field(default_factory=list)
    encoder_ids: list[int] = field(default_factory=list)
    cross_blocks: list[int] = field(default_factory=list)
    encoded: bool = False


class PagedDriver:
    """Runs sequences through a paged model step by step.

    ``step({seq: n})`` computes the next ``n`` not-yet-cached tokens of each named sequence in
    one packed batch and returns, per sequence, the logits of those tokens (``all_logits``) or
    of the last one.
    """

    def __init__(self, runner: Runner, spec: CacheSpec, num_blocks: int, seed: int = 0):
        self.runner = runner
        self.spec = spec
        self.kv_caches = spec.allocate(num_blocks)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.sequences: list[_Sequence] = []

    def add(self, tokens: Sequence[int], encoder_ids: Sequence[int] = ()) -> int:
        """Adds a sequence (its prompt, and for encoder-decoder models its encoder input);
        returns its id."""
        self.sequences.append(_Sequence(list(tokens), encoder_ids=list(encoder_ids)))
        return len(self.sequences) - 1

    def append(self, seq: int, token: int) -> None:
        self.sequences[seq].tokens.append(token)

    def _blocks(self, count: int, have: list[int]) -> None:
        block_size = self.spec.block_size
        while len(have) * block_size < count:
            have.append(self.free.pop())

    def step(self, new_tokens: dict[int, int], all_logits: bool = False) -> dict[int, torch.Tensor]:
        entries = []
        for seq_id, count in new_tokens.items():
            seq = self.sequences[seq_id]
            start = seq.num_cached
            if start + count > len(seq.tokens):
                raise ValueError(f"sequence {seq_id}: only {len(seq.tokens) - start} tokens left")
            self._blocks(start + count, seq.blocks)
            encode_now = bool(seq.encoder_ids) and not seq.encoded
            if encode_now:
                self._blocks(len(seq.encoder_ids), seq.cross_blocks)
            scheduled = ScheduledSequence(
                start,
                count,
                list(seq.blocks),
                encoder_len=len(seq.encoder_ids),
                encoder_block_ids=list(seq.cross_blocks),
                encode_now=encode_now,
            )
            entries.append(
                StepSequence(scheduled, seq.tokens, count if all_logits else 1, seq.encoder_ids)
            )
        model_input = pack_step(entries, self.spec.block_size)
        logits, self.kv_caches = self.runner(StepTensors(model_input).index_args(), self.kv_caches)
        for seq_id, count in new_tokens.items():
            self.sequences[seq_id].num_cached += count
            self.sequences[seq_id].encoded = True
        rows = torch.tensor(model_input.sampling_seqs)
        return {seq_id: logits[rows == i] for i, seq_id in enumerate(new_tokens)}

    def prefill(self, all_logits: bool = False) -> dict[int, torch.Tensor]:
        """One step computing every not-yet-cached token of every sequence."""
        pending = {
            i: len(s.tokens) - s.num_cached
            for i, s in enumerate(self.sequences)
            if len(s.tokens) > s.num_cached
        }
        return self.step(pending, all_logits=all_logits)

    def greedy(self, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Prefills every sequence, then decodes ``steps`` tokens greedily for all of them in
        batched steps; returns per sequence the generated tokens and the logits
        ``[steps, vocab]`` each was chosen from."""
        generated: list[list[int]] = [[] for _ in self.sequences]
        chosen_from: list[list[torch.Tensor]] = [[] for _ in self.sequences]
        logits = self.prefill()
        for step in range(steps):
            for seq_id, row in logits.items():
                token = int(row[-1].argmax())
                generated[seq_id].append(token)
                chosen_from[seq_id].append(row[-1])
                self.append(seq_id, token)
            if step + 1 < steps:
                logits = self.step(dict.fromkeys(logits, 1))
        return generated, [torch.stack(rows) for rows in chosen_from]

"""Engine configuration: the KV-cache pool and the scheduler's limits.

Every field has a default sized for the machine, so ``Engine(executor)`` works as is; set a field
to override it. Sizes are resolved once, when the engine is built (:func:`resolve_num_blocks`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from attnexport.errors import UserError
from attnexport.model_interface import CacheSpec
from attnexport.paged_inputs import MAX_SEQUENCE_LENGTH

PreemptionMode = Literal["swap", "recompute"]

DEFAULT_MAX_MODEL_LEN = 2048
# Without an explicit budget the device pool takes at most this share of the available memory.
_DEFAULT_MEMORY_FRACTION = 0.25


@dataclass
class CacheConfig:
    """The paged KV-cache pools.

    Give ``num_blocks`` or ``memory_bytes`` (a budget divided by ``CacheSpec.bytes_per_block``),
    or neither: then the pool holds the ``sequence_tokens`` when they are given, else
    ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at a quarter of the memory
    available on the device. A pool larger than the memory available is refused.
    """

    num_blocks: int | None = None
    """Blocks in the device pool (each holds ``block_size`` tokens of every layer)."""
    memory_bytes: int | None = None
    """Budget for the device pool in bytes (used when ``num_blocks`` is None)."""
    sequence_tokens: tuple[int, ...] | None = None
    """The length (prompt + generated tokens) of every sequence the engine will run, when they
    are known before it starts (``attnexport run``: each request's prompt + ``max_tokens``, once
    per sample). The default pool then holds them all at once (at most the default size), and
    need only hold the longest of them rather than one of ``max_model_len`` tokens."""
    swap_space_bytes: int = 256 * 2**20
    """Budget of the CPU pool that preempted sequences are swapped to."""
    num_cpu_blocks: int | None = None
    """Blocks in the CPU swap pool; overrides ``swap_space_bytes``."""
    enable_prefix_caching: bool = True
    """Reuse the cached KV of full prompt blocks shared with earlier requests."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "memory_bytes", "num_cpu_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise UserError(f"CacheConfig.{name}: expected a non-negative int, got {value!r}")
        if self.sequence_tokens is not None:
            self.sequence_tokens = tuple(self.sequence_tokens)
            if not self.sequence_tokens or not all(
                isinstance(t, int) and t > 0 for t in self.sequence_tokens
            ):
                raise UserError(
                    "CacheConfig.sequence_tokens: expected positive ints, got "
                    f"{self.sequence_tokens[:8]!r}"
                )
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise UserError(
                "CacheConfig.swap_space_bytes: expected a non-negative int, "
                f"got {self.swap_space_bytes!r}"
            )


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""The step's token budget when :class:`SchedulerConfig` leaves it to the model."""


@dataclass
class SchedulerConfig:
    """Limits of one engine step."""

    max_num_seqs: int = 64
    """Sequences running at once (each of a request's ``n`` samples counts)."""
    max_num_batched_tokens: int | None = None
    """Tokens computed in one step, prefill chunks and decodes together. None: 2048, or a
    LongRoPE model's ``rope_switch_length + 1`` when that is more (the recomputation of a
    sequence past its switch runs in one step; Phi-3's switch is 4096): see :meth:`resolved`."""
    max_model_len: int | None = None
    """Prompt + generated tokens per sequence; None takes the model's own limit (or 2048)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step's token budget over several steps."""
    preemption_mode: PreemptionMode = "recompute"
    """How a sequence is evicted when the pool runs out: ``swap`` its blocks to the CPU pool, or
    free them and ``recompute`` its tokens later. Swap falls back to recompute when the CPU pool
    is full."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "max_num_batched_tokens" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise UserError(f"SchedulerConfig.{name}: expected a positive int, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int)
            or not 1 <= self.max_model_len <= MAX_SEQUENCE_LENGTH
        ):
            raise UserError(
                f"SchedulerConfig.max_model_len: expected a positive int (at most "
                f"{MAX_SEQUENCE_LENGTH}: sequence lengths are int32) or None, "
                f"got {self.max_model_len!r}"
            )
        if self.preemption_mode not in ("swap", "recompute"):
            raise UserError(
                "SchedulerConfig.preemption_mode: expected 'swap' or 'recompute', "
                f"got {self.preemption_mode!r}"
            )

    def resolved(self, rope_switch_length: int | None) -> SchedulerConfig:
        """This config with its token budget decided for a model whose LongRoPE switch length
        is ``rope_switch_length`` (None: no switch). A budget given explicitly is kept (a
        request it cannot schedule is refused when added)."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if rope_switch_length is not None:
            budget = max(budget, rope_switch_length + 1)
        return dataclasses.replace(self, max_num_batched_tokens=budget)


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """How the engine starts the decoder of an encoder-decoder model (``attnexport run`` reads
    it from the export manifest, i.e. the checkpoint's generation config).

    The encoder runs on the whole prompt: like transformers' ``generate`` for encoder-decoders
    (which, unlike for decoders, infers no attention mask from pad tokens in ``input_ids``),
    nothing is masked."""

    decoder_start_token_id: int
    """The token every decoder sequence starts with (not reported as generated)."""

    def __post_init__(self) -> None:
        value = self.decoder_start_token_id
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(
                "EncoderDecoderConfig.decoder_start_token_id: expected a token id (int >= 0), "
                f"got {value!r}"
            )


def available_memory_bytes(device_type: str) -> int:
    """Memory that could be given to a KV pool on ``device_type`` now (free, not total)."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def checked_max_model_len(requested: int | None, limit: int | None, declared_by: str) -> int | None:
    """The length limit to run with: ``requested`` (None: ``limit``), refused above ``limit``,
    the model's own (the positions it was trained for, as ``declared_by`` declares them).

    A longer limit would let one request run positions the model has no embedding for, or
    was never trained on; the executor refuses such a step, which would fail every request
    batched with it. So it is refused here, before anything runs."""
    if requested is None:
        return limit
    if limit is not None and requested > limit:
        raise UserError(
            f"max_model_len: {requested} is longer than the model's maximum length {limit} "
            f"({declared_by}); use at most {limit}"
        )
    return requested


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def resolve_num_blocks(
    cache_config: CacheConfig,
    spec: CacheSpec,
    max_num_seqs: int,
    max_model_len: int,
    device_type: str,
) -> tuple[int, int]:
    """The (device, CPU) pool sizes in blocks for ``cache_config``.

    Raises ValueError if the device pool cannot hold one sequence of ``max_model_len`` tokens
    (or the longest of ``cache_config.sequence_tokens``: no request of that length could ever
    finish), or if it needs more than the memory available on the device.
    """
    per_block = spec.bytes_per_block
    lengths = cache_config.sequence_tokens
    longest = max_model_len if lengths is None else min(max(lengths), max_model_len)
    min_blocks = blocks_for_tokens(longest, spec.block_size)
    available = available_memory_bytes(device_type)
    if cache_config.num_blocks is not None:
        num_blocks = cache_config.num_blocks
    elif cache_config.memory_bytes is not None:
        num_blocks = cache_config.memory_bytes // per_block
    else:
        if lengths is None:
            wanted = max_num_seqs * min_blocks
        else:
            wanted = sum(blocks_for_tokens(min(t, max_model_len), spec.block_size) for t in lengths)
        cap = int(available * _DEFAULT_MEMORY_FRACTION) // per_block
        num_blocks = max(min(wanted, cap), min_blocks)
    what = f"max_model_len={max_model_len}" if lengths is None else f"{longest} (its longest)"
    if num_blocks < min_blocks:
        raise UserError(
            f"CacheConfig: a pool of {num_blocks} blocks ({num_blocks * per_block} bytes) cannot "
            f"hold one sequence of {what} tokens; expected at least "
            f"{min_blocks} blocks ({min_blocks * per_block} bytes at {per_block} bytes per block)"
            " or a smaller max_model_len"
        )
    if num_blocks * per_block > available:
        hint = (
            f"a pool that holds one sequence of {what} tokens; use a smaller max_model_len"
            if num_blocks == min_blocks
            else "use a smaller pool (num_blocks, memory_bytes, --kv-cache-memory)"
        )
        raise UserError(
            f"CacheConfig: a KV-cache pool of {num_blocks} blocks needs "
            f"{_gib(num_blocks * per_block)}, more than the {_gib(available)} of memory "
            f"available on {device_type} ({hint})"
        )
    if cache_config.num_cpu_blocks is not None:
        num_cpu_blocks = cache_config.num_cpu_blocks
    else:
        # The CPU pool holds self-attention blocks only (cross blocks are never swapped).
        self_only = dataclasses.replace(spec, num_cross_layers=0)
        num_cpu_blocks = cache_config.swap_space_bytes // self_only.bytes_per_block
    return num_blocks, num_cpu_blocks


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"

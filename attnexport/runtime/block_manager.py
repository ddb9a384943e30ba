"""The paged KV-cache pools: block allocation, reference counts, copy-on-write, prefix caching
and swapping to a CPU pool.

Only block *ids* live here; the executor owns the cache tensors and applies the block moves the
manager records (swaps and copy-on-write copies) before each model step.

Prefix caching: a full block is identified by its tokens and the identity of the block before
it, so a hit on block i implies the whole prefix up to it matches (for an encoder-decoder the
first block's predecessor is the encoder input, which every decoder block depends on; for a
LongRoPE model it also records whether the sequence is past the RoPE switch length, see
``rope_switch_length``). Blocks
whose last reference is dropped stay in the cache (and can be hit again) until they are
reused, least recently freed first.

Encoder-decoder models have a second device pool, ``cross``, of as many blocks: the cross caches
are tensors of their own (``CacheSpec.num_cross_layers``), so self block ``b`` and cross block
``b`` are distinct memory. A request's cross blocks hold its encoder output, are shared by its
samples, and are freed with the request or when it is preempted by recomputation; a request
swapped out keeps them on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from attnexport.runtime.config import blocks_for_tokens
from attnexport.runtime.sequence import Request, SequenceState

BlockKey = tuple[int, tuple[int, ...]]
"""(hash of the previous block's key, the block's token ids): what a cached block holds."""


def _first_predecessor(seq: SequenceState, long_rope: bool = False) -> int:
    """What a sequence's first block follows: nothing (0), or the encoder input it attends;
    for a LongRoPE model past its switch length (``long_rope``), also the RoPE regime, so
    that blocks computed with the long factors are never hits of a sequence computed with
    the short ones, or the other way round."""
    encoder = seq.request.encoder
    base = 0 if encoder is None else hash(tuple(encoder.token_ids))
    return hash((base, "long_rope")) if long_rope else base


class BlockPool:
    """The blocks of one pool (device or CPU): free list, reference counts, cache index.

    A freed block is handed out again before a block never used (the most recently freed
    first), and never-used blocks go in id order: the blocks ever used are ``[0,
    high_water)``, as few as the peak load needed, so a pool whose memory is committed as it
    is first written (:class:`~attnexport.runtime.executors.cache_pool.NumpyCachePool`)
    grows with the load rather than cycling through all its memory."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.high_water = 0
        """Blocks ``[0, high_water)`` have been handed out at least once."""
        self._free: list[int] = []  # freed blocks, reused last-freed first
        # Cached blocks nobody references, oldest first: reusable, and evicted in this order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (free, never-used or evictable cached blocks)."""
        return len(self._free) + self.num_blocks - self.high_water + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def allocate(self) -> int:
        """A block with one reference; evicts the least recently freed cached block if needed."""
        if self._free:
            block = self._free.pop()
        elif self.high_water < self.num_blocks:
            block = self.high_water
            self.high_water += 1
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        else:
            raise RuntimeError("BlockPool.allocate: no free block (the caller checks first)")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise RuntimeError(f"BlockPool.decref: block {block} is already free")
        self.ref_counts[block] = count
        if count == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding ``key``, if any (its reference count is not changed)."""
        return self._block_of.get(key)

    def is_evictable(self, block: int) -> bool:
        return self.ref_counts[block] == 0 and block in self._evictable

    def register(self, block: int, key: BlockKey) -> None:
        """Records that the full block ``block`` holds ``key`` (first holder wins)."""
        if self.enable_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key


class BlockManager:
    """Block tables of every sequence over a device pool, a CPU swap pool and (encoder-decoder
    models) a cross-attention pool.

    The scheduler asks whether work fits (:meth:`can_grow`, :meth:`can_swap_in`,
    :meth:`can_admit`) and hands blocks out and back (:meth:`allocate`, :meth:`admit`,
    :meth:`free`, :meth:`free_swapped`, ...); the pools stay the block manager's own. Block
    moves decided while scheduling a step accumulate in ``pending_copies`` (copy-on-write,
    within the device pool); swaps are returned by :meth:`swap_out`/:meth:`swap_in`. The engine
    hands them to the executor before running the step.
    """

    def __init__(
        self,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cross: bool = False,
        rope_switch_length: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.rope_switch_length = rope_switch_length
        """LongRoPE: a sequence longer than this is computed with the long factors (the
        scheduler sees to it), and its blocks are cached under keys of that regime."""
        self.device = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks)
        self.cross = BlockPool(num_blocks if cross else 0)
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        """Blocks of the device pool."""
        return self.device.num_blocks

    # ------------------------------------------------------------------ what fits
    def can_grow(self, plan: Iterable[tuple[SequenceState, int]]) -> bool:
        """The running (sequence, new tokens) pairs of ``plan`` get their blocks now."""
        return self.blocks_needed(plan) <= self.device.num_free

    def can_swap_in(
        self, seqs: list[SequenceState], plan: Iterable[tuple[SequenceState, int]]
    ) -> bool:
        """The swapped-out ``seqs`` (one request) come back and ``plan`` gets its blocks."""
        need = self.swap_in_cost(seqs) + self._blocks_needed(plan, self.cpu)
        return need <= self.device.num_free

    def can_admit(
        self, request: Request, plan: list[tuple[SequenceState, int]], hits: list[list[int]]
    ) -> bool:
        """:meth:`admit` of ``request`` with ``plan`` and its cached ``hits`` fits now."""
        return (
            self.admission_cost(plan, hits) <= self.device.num_free
            and self.cross_blocks_needed(request) <= self.cross.num_free
        )

    # ------------------------------------------------------------------ prefix cache
    def _key(self, seq: SequenceState, index: int) -> BlockKey:
        """The cache key of full block ``index`` of ``seq`` (keys are computed once, in order)."""
        keys = seq.block_hashes
        bs = self.block_size
        while len(keys) <= index:
            i = len(keys)
            previous = hash(keys[i - 1]) if i else _first_predecessor(seq, self._long_rope(seq))
            keys.append((previous, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return keys[index]

    def _long_rope(self, seq: SequenceState) -> bool:
        """Whether ``seq``'s blocks hold (or, admitted now, will hold) keys of LongRoPE's long
        regime: its cache's regime once it has one, else whether it is longer than the switch
        length (the scheduler computes such a sequence in the long regime only)."""
        switch = self.rope_switch_length
        if switch is None:
            return False
        if seq.num_computed:
            return seq.long_rope
        return len(seq.token_ids) > switch

    def match_prefix(self, seq: SequenceState) -> list[int]:
        """Cached device blocks holding the leading full blocks of ``seq``'s tokens. At least two
        tokens are left to compute (one, for a one-token sequence): the step produces logits,
        and the last rows run the attention kernel's prefill path as they did when the prompt
        was computed whole (a one-token step runs its decode path, whose sums round
        differently: the same prompt would answer differently on a cache hit). Nothing is
        reserved."""
        if not self.device.enable_caching or seq.block_ids:
            return []
        keys = seq.block_hashes
        if (
            keys
            and self.rope_switch_length is not None
            and keys[0][0] != _first_predecessor(seq, self._long_rope(seq))
        ):
            seq.block_hashes = []  # keys of the other RoPE regime (it grew past the switch)
        hits = []
        for index in range(max(len(seq.token_ids) - 2, 0) // self.block_size):
            block = self.device.lookup(self._key(seq, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def take_prefix(self, seq: SequenceState, hits: list[int]) -> None:
        """Makes the cached blocks ``hits`` (from :meth:`match_prefix`) the first blocks of
        ``seq`` and marks their tokens computed."""
        for block in hits:
            self.device.incref(block)
        seq.block_ids = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def admission_cost(self, plan: list[tuple[SequenceState, int]], hits: list[list[int]]) -> int:
        """Device blocks that :meth:`admit` takes from the free count: the new blocks of each
        (sequence, new tokens) pair of ``plan`` after its cached ``hits``, plus every distinct
        hit block nobody holds (taking it makes it unevictable; samples may hit the same one)."""
        bs = self.block_size
        need = 0
        unheld: set[int] = set()
        for (_, count), seq_hits in zip(plan, hits, strict=True):
            unheld.update(b for b in seq_hits if self.device.is_evictable(b))
            need += blocks_for_tokens(len(seq_hits) * bs + count, bs) - len(seq_hits)
        return need + len(unheld)

    def admit(
        self, request: Request, plan: list[tuple[SequenceState, int]], hits: list[list[int]]
    ) -> None:
        """Gives ``request`` its cross blocks (an encoder-decoder's) and the sequences of
        ``plan`` (the request's, holding no blocks) their cached ``hits`` and the blocks for
        their new tokens.

        Every sequence takes its hits before any sequence allocates: an allocation evicts the
        least recently freed cached block, which could otherwise be a hit another sample of the
        request is about to take (that sample would then read the allocating sample's keys and
        values)."""
        self.allocate_cross(request)
        for (seq, _), seq_hits in zip(plan, hits, strict=True):
            self.take_prefix(seq, seq_hits)
        for seq, count in plan:
            self.allocate(seq, count)

    def register_full_blocks(self, seq: SequenceState) -> None:
        """Adds the blocks of ``seq`` that are now full and computed to the prefix cache."""
        if not self.device.enable_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_ids))
        for index in range(seq.num_registered_blocks, full):
            self.device.register(seq.block_ids[index], self._key(seq, index))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    # ------------------------------------------------------------------ cross-attention blocks
    def cross_blocks_needed(self, request: Request) -> int:
        """Cross blocks that :meth:`allocate_cross` will take for ``request`` (0 when it has
        them, or is not an encoder-decoder request)."""
        encoder = request.encoder
        if encoder is None or encoder.block_ids:
            return 0
        return blocks_for_tokens(encoder.num_tokens, self.block_size)

    def allocate_cross(self, request: Request) -> None:
        """Gives ``request`` the cross blocks its encoder output is written to (once)."""
        for _ in range(self.cross_blocks_needed(request)):
            request.encoder.block_ids.append(self.cross.allocate())

    def free_cross(self, request: Request) -> None:
        """Frees ``request``'s cross blocks; its encoder must run again before it decodes."""
        encoder = request.encoder
        if encoder is None:
            return
        for block in encoder.block_ids:
            self.cross.decref(block)
        encoder.block_ids = []
        encoder.encoded = False

    # ------------------------------------------------------------------ growth
    def blocks_needed(self, plan: Iterable[tuple[SequenceState, int]]) -> int:
        """Device blocks that :meth:`allocate` will take for the (sequence, new tokens) pairs of
        ``plan``, allocated in that order: new blocks, plus the copies of shared blocks about to
        be written (the last holder of a block writes it in place)."""
        return self._blocks_needed(plan, self.device)

    def _blocks_needed(self, plan: Iterable[tuple[SequenceState, int]], pool: BlockPool) -> int:
        """:meth:`blocks_needed` of sequences whose blocks are in ``pool`` now (the CPU pool
        for swapped sequences)."""
        needed = 0
        writers: dict[int, int] = {}
        for seq, count in plan:
            total = blocks_for_tokens(seq.num_computed + count, self.block_size)
            needed += max(0, total - len(seq.block_ids))
            first = seq.num_computed // self.block_size
            if first < len(seq.block_ids):
                block = seq.block_ids[first]
                writers[block] = writers.get(block, 0) + 1
        for block, count in writers.items():
            needed += count if count < pool.ref_counts[block] else count - 1
        return needed

    def allocate(self, seq: SequenceState, num_new_tokens: int) -> None:
        """Gives ``seq`` the blocks its next ``num_new_tokens`` tokens are written to; a shared
        block about to be written is copied first (recorded in ``pending_copies``)."""
        first = seq.num_computed // self.block_size
        if first < len(seq.block_ids) and self.device.ref_counts[seq.block_ids[first]] > 1:
            shared = seq.block_ids[first]
            copy = self.device.allocate()
            self.pending_copies.append((shared, copy))
            self.device.decref(shared)
            seq.block_ids[first] = copy
        total = blocks_for_tokens(seq.num_computed + num_new_tokens, self.block_size)
        for _ in range(total - len(seq.block_ids)):
            seq.block_ids.append(self.device.allocate())

    def fork(
        self, parent: SequenceState, child: SequenceState, num_blocks: int | None = None
    ) -> None:
        """``child`` shares the first ``num_blocks`` blocks of ``parent`` (default: all, with
        their computed tokens); the tokens they hold must be the same in both."""
        if num_blocks is None:
            shared, computed = parent.block_ids, parent.num_computed
        else:
            shared, computed = parent.block_ids[:num_blocks], num_blocks * self.block_size
        for block in shared:
            self.device.incref(block)
        child.block_ids = list(shared)
        child.block_hashes = parent.block_hashes[: len(shared)]
        child.num_computed = computed
        child.num_registered_blocks = min(parent.num_registered_blocks, len(shared))
        child.long_rope = parent.long_rope

    def free_swapped(self, seq: SequenceState) -> None:
        """Drops ``seq``'s references to its blocks in the CPU pool (it is swapped out)."""
        for block in seq.block_ids:
            self.cpu.decref(block)
        seq.block_ids = []

    def free(self, seq: SequenceState) -> None:
        """Drops ``seq``'s references to its device blocks (tail first, so that a prefix stays
        cached longest) and resets it to nothing computed."""
        for block in reversed(seq.block_ids):
            self.device.decref(block)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_registered_blocks = 0
        seq.long_rope = False

    # ------------------------------------------------------------------ swapping
    @staticmethod
    def _distinct_blocks(seqs: Iterable[SequenceState]) -> set[int]:
        return {block for seq in seqs for block in seq.block_ids}

    def can_swap_out(self, seqs: list[SequenceState]) -> bool:
        return len(self._distinct_blocks(seqs)) <= self.cpu.num_free

    def swap_in_cost(self, seqs: list[SequenceState]) -> int:
        """Device blocks that swapping ``seqs`` back in takes."""
        return len(self._distinct_blocks(seqs))

    def swap_out(self, seqs: list[SequenceState]) -> list[tuple[int, int]]:
        """Moves the blocks of ``seqs`` (one request) to the CPU pool; returns the
        (device block, CPU block) copies to make. Blocks shared with other requests stay on the
        device for them."""
        return self._move(seqs, self.device, self.cpu)

    def swap_in(self, seqs: list[SequenceState]) -> list[tuple[int, int]]:
        """Moves the blocks of ``seqs`` back to the device pool; returns the (CPU block,
        device block) copies to make."""
        moves = self._move(seqs, self.cpu, self.device)
        for seq in seqs:
            seq.num_registered_blocks = 0  # new device blocks: register them again
        return moves

    @staticmethod
    def _move(seqs: list[SequenceState], src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in seqs:
            moved = []
            for block in seq.block_ids:
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.decref(block)
                moved.append(mapping[block])
            seq.block_ids = moved
        return list(mapping.items())

    # ------------------------------------------------------------------ accounting
    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def num_used_blocks(self) -> int:
        """Device blocks referenced by some sequence."""
        return self.device.num_blocks - self.device.num_free

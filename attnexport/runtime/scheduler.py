"""Continuous batching: which sequences compute how many tokens in the next step.

Each step spends a budget of ``max_num_batched_tokens`` tokens over at most ``max_num_seqs``
sequences, in this order:

1. running requests, oldest first: one token per decoding sequence, the next chunk of a prompt
   being prefilled (chunked prefill). While requests wait to start, a prompt chunk leaves
   ``waiting_reserve_tokens`` of the budget to them: a short prompt arriving while a long one
   is prefilled starts in the next step, not after the long prompt's last chunk. When the device
   pool cannot hold a request's tokens, the youngest running request is preempted (swapped to
   the CPU pool or freed for recomputation) until it can, and a request that has to preempt
   itself waits;
2. if nothing was preempted: swapped requests, oldest first, when their blocks fit again;
3. if nothing is swapped: waiting requests, oldest first (first the prefix-cache lookup, so a
   cached prefix costs neither tokens nor blocks).

LongRoPE models (``rope_switch_length`` set): a sequence's keys are rotated with the long
factors once it is longer than the switch length, as transformers' ``generate`` does by
recomputing the whole sequence when it grows past it. So a running (or swapped) request whose
sequence is now longer than the switch while its cache was computed at or below it is
preempted by recomputation (blocks freed, back to the waiting queue by age) and prefilled again
over all its tokens; and a chunk of a sequence longer than the switch always ends past it
(its first computed chunk covers at least ``rope_switch_length + 1`` tokens), so no key of
such a sequence is computed with the short factors.

An encoder-decoder request is admitted with its cross blocks, and its encoder tokens count
against the step's budget in the step that admits it (the encoder input is never chunked).
Preempting it by recomputation frees its cross blocks too: the encoder runs again when it is
readmitted. Swapping keeps them on the device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from attnexport.runtime.block_manager import BlockManager
from attnexport.runtime.config import SchedulerConfig
from attnexport.runtime.sequence import Request, SequenceState, Status


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: the sequences in batch order with their token counts, and the block moves
    to apply before the model runs, in this order: swap-outs, swap-ins, copy-on-write copies."""

    seqs: list[SequenceState] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, CPU block) pairs."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) device blocks (copy-on-write)."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(CPU block, device block) pairs."""
    preempted: list[Request] = field(default_factory=list)
    recomputed: list[Request] = field(default_factory=list)
    """Requests preempted by recomputation because they grew past the RoPE switch length
    (not for lack of blocks: queued requests are still admitted in this step)."""
    failed: list[Request] = field(default_factory=list)
    """Requests that can never fit the pool; the engine finishes them with their error."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: SequenceState, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


def _insert_by_age(queue: list[Request], request: Request) -> None:
    bisect.insort(queue, request, key=lambda r: r.arrival_index)


class Scheduler:
    """Queues of requests and the per-step policy above."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        rope_switch_length: int | None = None,
    ) -> None:
        self.config = config.resolved(rope_switch_length)
        self.block_manager = block_manager
        self.rope_switch_length = rope_switch_length
        """The model's LongRoPE switch length (None: no regime switch, no checks)."""
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        # Running sequences, counted as each request's n before its prompt forks.
        self._num_running_seqs = 0

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        _insert_by_age(self.waiting, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request) -> None:
        """Removes a finished (or failed, or aborted) request and frees its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                if queue is self.running:
                    self._num_running_seqs -= self._seq_slots(request)
        pool_of_swapped = request.status == Status.SWAPPED
        for seq in request.seqs:
            self._release(seq, pool_of_swapped)
        self.block_manager.free_cross(request)
        request.status = Status.FINISHED

    def free_finished_seq(self, seq: SequenceState) -> None:
        """Frees a sequence that finished while its request goes on."""
        self._release(seq, swapped=False)
        self._num_running_seqs -= 1

    def _release(self, seq: SequenceState, swapped: bool) -> None:
        if swapped:
            self.block_manager.free_swapped(seq)
        else:
            self.block_manager.free(seq)

    def _has_seq_slots(self, request: Request) -> bool:
        """Starting ``request`` keeps the running sequences within ``max_num_seqs``."""
        return self._num_running_seqs + self._seq_slots(request) <= self.config.max_num_seqs

    @staticmethod
    def _seq_slots(request: Request) -> int:
        """Sequence slots the request holds: n until its prompt forks, then its live samples."""
        if len(request.seqs) < request.params.n:
            return request.params.n
        return len(request.unfinished_seqs())

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        switch = self.rope_switch_length

        # Left to the waiting requests by the running prompts' chunks, when the oldest of them
        # could start (nothing swapped comes first, a sequence slot is free).
        waiting_first = self.waiting and not self.swapped and self._has_seq_slots(self.waiting[0])
        reserve = self.config.waiting_reserve_tokens if waiting_first else 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if switch is not None and self._crosses_switch(request, switch):
                self._preempt(request, batch, regime_switch=True)
                continue
            plan, cost = self._plan(request, budget, reserve)
            if not plan:
                index += 1
                continue
            while not bm.can_grow(plan):
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    self._fail_too_large(request, batch)
                    break
                self._preempt(victim, batch)
                if victim is request:
                    break
            if request.status != Status.RUNNING:
                continue  # it was preempted or failed: it was the last running request
            for seq, count in plan:
                bm.allocate(seq, count)
                batch.add(seq, count)
            budget -= cost
            index += 1

        if not batch.preempted:
            if self.swapped:
                budget = self._schedule_swapped(batch, budget)
            if not self.swapped and self.waiting:
                self._schedule_waiting(batch, budget)
        if not batch.seqs and not batch.failed and not batch.preempted:
            # Nothing runs, so the whole pool was free: the oldest queued request can never fit.
            stuck = self.swapped[0] if self.swapped else self.waiting[0] if self.waiting else None
            if stuck is not None:
                self._fail_too_large(stuck, batch)
        batch.copies = bm.take_pending_copies()
        return batch

    @staticmethod
    def _crosses_switch(request: Request, switch: int) -> bool:
        """A sequence of ``request`` is longer than the RoPE switch length while its cache
        holds keys computed at or below it (with the short factors)."""
        for seq in request.seqs:
            if len(seq.token_ids) > switch and seq.num_computed and not seq.long_rope:
                return True
        return False

    def _waits_for_leader(self, request: Request, seq: SequenceState) -> bool:
        """After a recomputation, a forked sample waits until the first unfinished sample (the
        leader) has recomputed the shared prompt blocks, then shares them."""
        shared = request.shared_prefix_len
        if not shared or seq.block_ids or seq.num_computed:
            return False
        leader = request.unfinished_seqs()[0]
        if seq is leader:
            return False
        if leader.num_computed < shared or request.status is Status.SWAPPED:
            # While swapped out the leader's block ids are CPU blocks: share them once back.
            return True
        self.block_manager.fork(leader, seq, shared // self.block_manager.block_size)
        return False

    def _plan(
        self, request: Request, budget: int, reserve: int = 0
    ) -> tuple[list[tuple[SequenceState, int]], int]:
        """(sequence, tokens) pairs for ``request`` within ``budget``, and their token total; a
        prompt chunk (more than one token) leaves ``reserve`` tokens of the budget unused."""
        plan, cost = [], 0
        switch = self.rope_switch_length
        for seq in request.seqs:  # not unfinished_seqs(): no list built for every request
            if seq.finished or (request.shared_prefix_len and self._waits_for_leader(request, seq)):
                continue
            uncomputed = seq.num_uncomputed
            room = budget - cost - (reserve if uncomputed > 1 else 0)
            count = self._chunk(uncomputed, room)
            if count <= 0:
                break
            if count < uncomputed and not self.config.enable_chunked_prefill:
                break
            if switch is not None and not self._rope_regime_ok(seq, seq.num_computed, count):
                break
            plan.append((seq, count))
            cost += count
        return plan, cost

    def _chunk(self, uncomputed: int, room: int) -> int:
        """Tokens of a sequence's ``uncomputed`` ones that a step with ``room`` tokens left
        computes: all that fit, but a prompt (more than one token left) never leaves, nor
        computes, a chunk of exactly one token. A one-token step of a sequence runs the
        attention kernel's decode path, whose sums round differently from the prefill path's
        (each is batch-invariant on its own): a prompt's last rows would then depend on how the
        budget happened to chunk it, which is on what it ran with, and a quantized model's
        greedy tokens can follow such a last-bit difference. So a chunk that would leave one
        token leaves two, and a room of one token (or two that would leave one) waits for
        the next step; budgets under 3 tokens chunk as they fall."""
        count = min(uncomputed, room)
        if count >= uncomputed or uncomputed < 2 or self.config.max_num_batched_tokens < 3:
            return count
        if uncomputed - count == 1:
            count -= 1
        return count if count >= 2 else 0

    def _rope_regime_ok(self, seq: SequenceState, computed: int, count: int) -> bool:
        """Computing ``count`` tokens of ``seq`` after its first ``computed`` keeps all its
        keys in one RoPE regime: a sequence longer than the switch length computes a chunk
        ending past it (its keys get the long factors), which then marks it long. A chunk
        ending at or below it would get the short factors: the sequence waits for a budget
        that holds the longer chunk (``RequestLimits`` refuses a request that never fits)."""
        switch = self.rope_switch_length
        if len(seq.token_ids) <= switch:
            return True
        if computed + count <= switch:
            return False
        seq.long_rope = True
        return True

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        switch = self.rope_switch_length
        while self.swapped and budget > 0:
            request = self.swapped[0]
            if switch is not None and self._crosses_switch(request, switch):
                # Its CPU blocks hold short-regime keys: drop them and recompute.
                self.swapped.pop(0)
                self._requeue_for_recompute(request, batch, swapped=True)
                continue
            if not self._has_seq_slots(request):
                break
            plan, cost = self._plan(request, budget)
            seqs = request.unfinished_seqs()
            if not plan or not bm.can_swap_in(seqs, plan):
                break
            self.swapped.pop(0)
            batch.swap_in += bm.swap_in(seqs)
            self._start_running(request)
            for seq, count in plan:
                bm.allocate(seq, count)
                batch.add(seq, count)
            budget -= cost
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._has_seq_slots(request):
                break
            seqs = [s for s in request.unfinished_seqs() if not self._waits_for_leader(request, s)]
            # A request scoring its prompt computes every prompt token (its logits are asked).
            hits = [[] if request.scores_prompt else bm.match_prefix(seq) for seq in seqs]
            encoder = request.encoder
            encoder_cost = encoder.num_tokens if encoder and not encoder.encoded else 0
            plan, cost = [], encoder_cost
            for seq, seq_hits in zip(seqs, hits, strict=True):
                cached = len(seq_hits) * bm.block_size
                remaining = seq.num_uncomputed - cached
                count = self._chunk(remaining, budget - cost)
                if count <= 0 or (count < remaining and not self.config.enable_chunked_prefill):
                    break
                if self.rope_switch_length is not None and not self._rope_regime_ok(
                    seq, cached, count
                ):
                    break
                plan.append((seq, count))
                cost += count
            # Samples left out by the token budget run in later steps, as running ones do.
            hits = hits[: len(plan)]
            if not plan or not bm.can_admit(request, plan, hits):
                break
            self.waiting.pop(0)
            bm.admit(request, plan, hits)
            for seq, count in plan:
                batch.add(seq, count)
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = len(hits[0]) * bm.block_size
            self._start_running(request)
            budget -= cost

    def _start_running(self, request: Request) -> None:
        request.status = Status.RUNNING
        _insert_by_age(self.running, request)
        self._num_running_seqs += self._seq_slots(request)

    # ------------------------------------------------------------------ preemption
    def _preempt(
        self, request: Request, batch: ScheduledBatch, regime_switch: bool = False
    ) -> None:
        """Evicts ``request`` (running, none of its tokens scheduled in this step); with
        ``regime_switch``, by recomputation because it grew past the RoPE switch length."""
        bm = self.block_manager
        self.running.remove(request)
        self._num_running_seqs -= self._seq_slots(request)
        seqs = request.unfinished_seqs()
        if not regime_switch and self.config.preemption_mode == "swap" and bm.can_swap_out(seqs):
            request.num_preemptions += 1
            batch.preempted.append(request)
            batch.swap_out += bm.swap_out(seqs)
            request.status = Status.SWAPPED
            _insert_by_age(self.swapped, request)
        else:
            self._requeue_for_recompute(request, batch, swapped=False, regime_switch=regime_switch)

    def _requeue_for_recompute(
        self,
        request: Request,
        batch: ScheduledBatch,
        swapped: bool,
        regime_switch: bool = True,
    ) -> None:
        """Frees the blocks of ``request`` (in the CPU pool when ``swapped``) and queues it
        to be computed again from its first token."""
        bm = self.block_manager
        request.num_preemptions += 1
        (batch.recomputed if regime_switch else batch.preempted).append(request)
        seqs = request.unfinished_seqs()
        for seq in seqs:
            if swapped:
                bm.free_swapped(seq)
            bm.free(seq)
        bm.free_cross(request)
        if len(seqs) > 1:
            request.shared_prefix_len = request.prompt_len // bm.block_size * bm.block_size
        request.status = Status.WAITING
        _insert_by_age(self.waiting, request)

    def _fail_too_large(self, request: Request, batch: ScheduledBatch) -> None:
        pool = self.block_manager.num_blocks
        request.error = (
            f"request {request.request_id}: its {len(request.unfinished_seqs())} sequence(s) need "
            f"more KV-cache blocks than the pool holds ({pool} blocks); use a larger "
            "CacheConfig.num_blocks/memory_bytes, a smaller n or fewer max_tokens"
        )
        batch.failed.append(request)
        self.finish(request)

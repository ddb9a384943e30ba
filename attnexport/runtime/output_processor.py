"""What a step's logits do to its sequences: a token sampled (or forced) per sampling row and
appended, stop and length checks, the fork of a prompt into its ``n`` samples, and the
release of what finishes.

Each request's share of this work is its own: an exception while sampling or appending one
request's tokens (a logits row that is NaN, a bug) fails that request alone, with its error
set and its blocks freed; the step's other requests take their tokens as usual."""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from attnexport.runtime.block_manager import BlockManager
from attnexport.runtime.sampling import (
    greedy_tokens,
    host_logits,
    make_generator,
    sample_token,
)
from attnexport.runtime.scheduler import Scheduler
from attnexport.runtime.sequence import Request, SequenceState, Status

logger = logging.getLogger("attnexport.runtime")


class OutputProcessor:
    """Turns logits into tokens for an engine's sequences (and creates its sequences, so that
    their ids come from one counter).

    Args:
        scheduler: finishes requests and frees the sequences that end.
        block_manager: shares a prompt's blocks with its forks.
        max_model_len: a sequence of this many tokens ends with ``"length"``.
    """

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._seq_ids = itertools.count()

    def new_sequence(
        self, request: Request, token_ids: list[int], sample_index: int
    ) -> SequenceState:
        """Sample ``sample_index`` of ``request`` starting from ``token_ids`` (with its random
        stream), added to the request's sequences."""
        seq = SequenceState(
            next(self._seq_ids),
            request,
            token_ids,
            sample_index,
            make_generator(request.params, sample_index),
        )
        request.seqs.append(seq)
        return seq

    def take_tokens(
        self,
        batch_seqs: list[SequenceState],
        rows: list[int],
        logits: np.ndarray,
        changed: list[Request],
    ) -> None:
        """Samples the next token of sequence ``batch_seqs[rows[i]]`` from row i of ``logits``
        ``[N, vocab]`` (a prompt that forks samples all of its n first tokens from the same
        row), appends it and finishes the requests that are done; adds their requests to
        ``changed``. A request whose row raises is failed (:meth:`_fail`), not the step."""
        logits = host_logits(logits)
        argmax = greedy_tokens(logits)
        now = time.perf_counter()
        ended = []
        # One loop, on cold caches: this runs every step.
        for row, i in enumerate(rows):
            seq = batch_seqs[i]
            request = seq.request
            if request.error is not None:
                continue  # another of its rows failed in this step
            try:
                token = sample_token(logits, row, request.params, seq.generator, argmax[row])
                token = self._forced(seq, token)
                if len(request.seqs) < request.params.n:
                    self._fork(seq, logits, row, argmax[row], token)
                else:
                    self._append(seq, token)
            except Exception as error:
                self._fail(request, error, now)
                changed.append(request)
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            changed.append(request)
            if seq.finished:
                ended.append(request)
        # Only a request whose sequence just ended can be finished (in the order of ``seqs``).
        if ended:
            for request in dict.fromkeys(ended):
                if request.finished and request.status is not Status.FINISHED:
                    request.finish_time = now
                    self.scheduler.finish(request)

    def _fail(self, request: Request, error: Exception, now: float) -> None:
        logger.error(
            "request %s failed while its tokens were taken", request.request_id, exc_info=error
        )
        self.fail(request, f"sampling failed: {type(error).__name__}: {error}", now)

    def fail(self, request: Request, message: str, now: float) -> None:
        """Finishes ``request`` with the error ``message``, the engine's fault (a server
        answers 500), and frees its blocks (unless it finished already)."""
        request.error, request.error_is_internal = message, True
        if request.status is not Status.FINISHED:
            request.finish_time = now
            self.scheduler.finish(request)

    def _forced(self, seq: SequenceState, token: int) -> int:
        """``token``, or the token the request's params force as ``seq``'s next one."""
        params = seq.request.params
        if params.forced_bos_token_id is None and params.forced_eos_token_id is None:
            return token
        generated = seq.num_output_tokens
        is_last = generated + 1 >= params.max_tokens or len(seq.token_ids) + 1 >= self.max_model_len
        forced = params.forced_token(generated, is_last)
        return token if forced is None else forced

    def _append(self, seq: SequenceState, token: int) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        if token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finished:
            self.scheduler.free_finished_seq(seq)

    def _fork(
        self, parent: SequenceState, logits: np.ndarray, row: int, argmax: int, first: int
    ) -> None:
        """The prompt of ``parent``'s request is computed: creates its other samples, each
        sharing the prompt's blocks and drawing its first token from the same ``row`` of
        ``logits`` (whose argmax is ``argmax``); ``parent`` takes ``first``."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = self.new_sequence(request, list(parent.token_ids), index)
            self.block_manager.fork(parent, child)
            children.append(child)
        self._append(parent, first)
        for child in children:
            token = sample_token(logits, row, request.params, child.generator, argmax)
            self._append(child, self._forced(child, token))

"""What a step's logits do to its sequences: a token sampled (or forced) per sampling row and
appended, stop and length checks, the fork of a prompt into its ``n`` samples, and the
release of what finishes. Requests that ask for log-probabilities get them from the raw rows
(:mod:`attnexport.runtime.logprobs`), before their parameters change their rows
(:mod:`attnexport.runtime.logits_processing`); a request's prompt rows, when it scores its
prompt, give its prompt log-probabilities. Plain requests take none of these paths.

Each request's share of this work is its own: an exception while sampling or appending one
request's tokens (a logits row that is NaN, a bug) fails that request alone, with its error
set and its blocks freed; the step's other requests take their tokens as usual."""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from attnexport.runtime.block_manager import BlockManager
from attnexport.runtime.logits_processing import process_logits
from attnexport.runtime.logprobs import log_softmax, score_rows, token_logprobs
from attnexport.runtime.model_input import ModelInput
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
        params = request.params
        seq = SequenceState(
            next(self._seq_ids),
            request,
            token_ids,
            sample_index,
            make_generator(params, sample_index),
        )
        if params.logprobs is not None:
            seq.logprobs = []
        if request.logits_plan is not None:
            seq.logits_state = request.logits_plan.new_sample()
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
        now = time.perf_counter()
        special = [row for row, i in enumerate(rows) if not batch_seqs[i].request.params.plain]
        raw = self._prepare(batch_seqs, rows, logits, special, now, changed) if special else None
        argmax = greedy_tokens(logits)
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
                logprob_row = raw.get(row) if raw else None
                if len(request.seqs) < request.params.n:
                    self._fork(seq, logits, row, argmax[row], token, logprob_row)
                else:
                    self._append(seq, token, logprob_row)
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

    def _prepare(
        self,
        batch_seqs: list[SequenceState],
        rows: list[int],
        logits: np.ndarray,
        special: list[int],
        now: float,
        changed: list[Request],
    ) -> dict[int, np.ndarray]:
        """The rows ``special`` of requests with logprobs or parameters that change their
        logits: returns the raw ``log_softmax`` of the rows that want log-probabilities (by
        row), then applies the requests' parameters to their rows in place. A request whose
        grammar fails is failed."""
        raw = {}
        processed, states = [], []
        for row in special:
            seq = batch_seqs[rows[row]]
            if seq.logprobs is not None:
                raw[row] = log_softmax(logits[row : row + 1])[0]
            if seq.logits_state is not None:
                processed.append(row)
                states.append(seq.logits_state)
        if processed:
            failed = process_logits(logits, processed, states)
            for index, error in failed.items():
                request = batch_seqs[rows[processed[index]]].request
                if request.error is None:
                    self._fail(request, error, now)
                    changed.append(request)
        return raw

    def score_prompts(
        self, batch_seqs: list[SequenceState], model_input: ModelInput, logits: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """A step whose scoring requests asked for their prompt rows: records their prompt
        log-probabilities (row at position j scores prompt token j + 1; positions already
        scored, after a recomputation, are skipped); returns the sampling rows of ``logits``
        and their sequences' batch indices, for :meth:`take_tokens`. A request whose scoring
        raises is failed alone."""
        logits = host_logits(logits)
        values = model_input.values
        positions, indices = values["positions"], values["logits_indices"]
        owners = model_input.sampling_seqs
        sample_rows = model_input.sample_rows
        sampling = set(sample_rows)
        wanted: dict[Request, tuple[list[int], list[int]]] = {}
        for row, i in enumerate(owners):
            if row in sampling:
                continue
            request = batch_seqs[i].request
            scores = request.prompt_logprobs
            position = positions[indices[row]]
            chosen = wanted.setdefault(request, ([], []))
            if len(scores) + len(chosen[0]) == position + 1 < len(request.prompt):
                chosen[0].append(row)
                chosen[1].append(request.prompt[position + 1])
        for request, (score_rows_, tokens) in wanted.items():
            if not score_rows_ or request.error is not None:
                continue
            try:
                entries = score_rows(logits[score_rows_], tokens, request.params.prompt_logprobs)
                request.prompt_logprobs.extend(entries)
            except Exception as error:
                self._fail(request, error, time.perf_counter())
        return logits[sample_rows], [owners[row] for row in sample_rows]

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

    def _append(
        self, seq: SequenceState, token: int, logprob_row: np.ndarray | None = None
    ) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        if seq.logprobs is not None:
            seq.logprobs.append(token_logprobs(logprob_row, token, params.logprobs))
        state = seq.logits_state
        if state is not None:
            state.append(token)
        if token in params.stop_token_ids or (state is not None and state.grammar_finished):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finished:
            self.scheduler.free_finished_seq(seq)

    def _fork(
        self,
        parent: SequenceState,
        logits: np.ndarray,
        row: int,
        argmax: int,
        first: int,
        logprob_row: np.ndarray | None,
    ) -> None:
        """The prompt of ``parent``'s request is computed: creates its other samples, each
        sharing the prompt's blocks and drawing its first token from the same ``row`` of
        ``logits`` (whose argmax is ``argmax``; ``logprob_row`` its raw log-probabilities, when
        asked); ``parent`` takes ``first``."""
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = self.new_sequence(request, list(parent.token_ids), index)
            self.block_manager.fork(parent, child)
            children.append(child)
        self._append(parent, first, logprob_row)
        for child in children:
            token = sample_token(logits, row, request.params, child.generator, argmax)
            self._append(child, self._forced(child, token), logprob_row)

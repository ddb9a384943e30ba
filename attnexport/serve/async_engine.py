"""One engine shared by many clients: a driver thread steps it, each request gets an async
stream of its outputs (vLLM's AsyncLLM pattern).

    engine = AsyncEngine(Engine(OrtExecutor("model.onnx")))
    engine.start()                                   # inside a running event loop
    group = engine.submit([[1, 2, 3]], [SamplingParams(max_tokens=8)])
    try:
        async for index, output in group:
            print(output.outputs[0].new_token_ids, output.finished)
    finally:
        group.abort()                                # a no-op once every request finished
    await engine.shutdown()

:class:`~attnexport.runtime.Engine` is single-threaded, so only the driver thread touches it:
coroutines (or other threads) hand it requests to add and ids to abort through a locked
inbox and wake it; after each step it puts the step's outputs in an outbox and, unless a
delivery is already scheduled, schedules one on the event loop (``call_soon_threadsafe``).
Delivery merges each output into its request's pending output: a consumer that fell behind
(a slow client, a busy loop) finds one output holding the tokens of several steps, never a
backlog, so neither memory nor the loop's work grows with the lag. An abort (a client that
went away) is applied before the driver's next step, so the request's blocks are free within
one step. The driver sleeps on an event while nothing is queued or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from attnexport.runtime.engine import Engine
from attnexport.runtime.outputs import RequestMetrics, RequestOutput
from attnexport.runtime.sampling import SamplingParams

logger = logging.getLogger("attnexport.serve")


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queued_requests`` allows (HTTP 503)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its driver thread died (HTTP 503)."""


@dataclass
class EngineState:
    """What the driver published after its last iteration (read by /metrics and the queue
    limit; plain ints, written by one thread)."""

    num_running: int = 0
    """Requests with running samples."""
    num_waiting: int = 0
    """Requests queued or preempted (swapped out)."""
    blocks_in_use: int = 0
    num_blocks: int = 0


@dataclass
class StepOutputs:
    """The outputs of one driver iteration, as delivered to the event loop."""

    time: float
    """``time.perf_counter()`` when the step's outputs were ready."""
    outputs: list[RequestOutput] = field(default_factory=list)


StepListener = Callable[[EngineState, StepOutputs], None]


class RequestGroup:
    """The requests of one :meth:`AsyncEngine.submit`, as an async iterator of
    ``(prompt index, output)``: each output's samples carry in ``new_token_ids`` their tokens
    since the previous output, and the last output of a request has ``finished``.

    Call :meth:`abort` when the consumer stops early (a client that went away, a stop string):
    the unfinished requests are aborted and their blocks are free after the driver's next
    iteration. It is idempotent and also what a finished group does to forget its requests.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self.time = 0.0
        """When the driver finished the step of the output last returned (perf_counter)."""
        self._pending: dict[str, RequestOutput] = {}
        self._ready = asyncio.Event()

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished:
            self.abort()
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        request_id = next(iter(self._pending))
        output = self._pending.pop(request_id)
        if output.finished:
            self.unfinished.discard(request_id)
        return self.index[request_id], output

    def _put(self, output: RequestOutput, time: float) -> None:
        """Event loop: a delivered output, merged into the request's pending one."""
        self.time = time
        pending = self._pending.get(output.request_id)
        if pending is not None:
            earlier = {sample.index: sample.new_token_ids for sample in pending.outputs}
            for sample in output.outputs:
                sample.new_token_ids = earlier.get(sample.index, []) + sample.new_token_ids
        self._pending[output.request_id] = output
        self._ready.set()

    def abort_one(self, index: int) -> None:
        """Aborts the request of prompt ``index`` (if it is still running)."""
        request_id = self.request_ids[index]
        if request_id in self.unfinished:
            self.engine.abort([request_id])

    def abort(self) -> None:
        """Aborts every unfinished request of the group and forgets the group."""
        self.engine._forget(self.request_ids)
        if self.unfinished:
            self.engine.abort(sorted(self.unfinished))
            self.unfinished.clear()


class AsyncEngine:
    """An :class:`~attnexport.runtime.Engine` stepped by one driver thread, shared by
    coroutines.

    Args:
        engine: the engine (built without a tokenizer: outputs are token ids; text is the
            caller's, see :mod:`attnexport.serve.app`).
        max_queued_requests: requests that may wait for a running slot (>= 1); one more is
            refused with :class:`QueueFullError` (None: no limit).
        on_step: called in the driver thread after each iteration with the engine state and
            the outputs (metrics).
    """

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int | None = None,
        on_step: StepListener | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests: expected >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_step = on_step
        self.state = EngineState(num_blocks=engine.num_blocks)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._groups: dict[str, RequestGroup] = {}  # event-loop side: request id -> group
        self._outbox: list[StepOutputs] = []  # driver -> event loop, under _lock
        self._delivery_scheduled = False
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the driver thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._drive, name="attnexport-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """The driver is up and accepting requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stop(self) -> None:
        """Stops accepting requests and aborts every one the driver holds: each ends with
        ``"aborted"`` (its consumer answers that the server is shutting down); the driver
        then exits. Safe from any thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """:meth:`stop`, then waits for the driver (at most ``timeout`` s)."""
        self.stop()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, timeout)

    # ------------------------------------------------------------------ requests
    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """Validates one request against the engine's limits (TypeError/ValueError naming the
        field, see :meth:`Engine.check_request`); safe from any thread: it reads only the
        engine's fixed limits."""
        return self.engine.check_request(prompt, params)

    def num_queued(self) -> int:
        """Requests waiting: handed to the driver and not picked up yet, or in its waiting
        queue at its last iteration."""
        with self._lock:
            pending = len(self._adds)
        return pending + self.state.num_waiting

    def submit(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> RequestGroup:
        """Queues the prompts (one request each); returns the async stream of their outputs.
        Every prompt is checked before any is queued (:meth:`check_all`, then
        :meth:`enqueue`).

        Raises:
            TypeError, ValueError: a bad prompt or parameters (the message names the field).
            QueueFullError: the waiting queue is full.
            EngineStoppedError: the engine is shutting down or its driver died.
        """
        return self.enqueue(self.check_all(prompts, params), params)

    def check_all(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Validates the prompts of one submission; returns them as lists of ints. Safe from
        any thread (it reads only fixed limits), so a server runs it off its event loop.

        Raises:
            TypeError, ValueError: a bad prompt or parameters, or more prompts than
                ``max_queued_requests`` (such a submission could never be queued).
        """
        self.check_count(len(prompts))
        return [self.check(p, q) for p, q in zip(prompts, params, strict=True)]

    def check_count(self, num_prompts: int) -> None:
        """ValueError unless ``num_prompts`` prompts can ever be queued at once."""
        limit = self.max_queued_requests
        if limit is not None and num_prompts > limit:
            raise ValueError(
                f"prompt: {num_prompts} prompts are more than the server can ever queue at "
                f"once (--max-queued-requests {limit}); send at most {limit} per request"
            )

    def enqueue(self, tokens: list[list[int]], params: Sequence[SamplingParams]) -> RequestGroup:
        """Queues prompts that :meth:`check_all` returned; the event loop's side of
        :meth:`submit`.

        Raises:
            QueueFullError: the waiting queue is full.
            EngineStoppedError: the engine is shutting down or its driver died.
        """
        if not self.running:
            raise EngineStoppedError(self._stopped_reason())
        limit = self.max_queued_requests
        if limit is not None and self.num_queued() + len(tokens) > limit:
            raise QueueFullError(
                f"the server is at capacity: {self.num_queued()} requests are waiting "
                f"(--max-queued-requests {limit}); retry later"
            )
        group = RequestGroup(self, [f"srv-{next(self._ids)}" for _ in tokens])
        for request_id in group.request_ids:
            self._groups[request_id] = group
        with self._lock:
            self._adds.extend(zip(group.request_ids, tokens, params, strict=True))
        self._wake.set()
        return group

    def abort(self, request_ids: Sequence[str] | set[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); safe from any thread."""
        with self._lock:
            self._aborts.extend(request_ids)
        self._wake.set()

    def _forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._groups.pop(request_id, None)

    def _stopped_reason(self) -> str:
        if self._error is not None:
            return f"the engine stopped after an error: {type(self._error).__name__}: {self._error}"
        return "the server is shutting down"

    # ------------------------------------------------------------------ event-loop side
    def _deliver(self) -> None:
        with self._lock:
            steps, self._outbox = self._outbox, []
            self._delivery_scheduled = False
        for step in steps:
            for output in step.outputs:
                group = self._groups.get(output.request_id)
                if group is not None:  # else its consumer left; the abort is on its way
                    group._put(output, step.time)

    def _send(self, step: StepOutputs) -> None:
        """Driver thread: puts ``step`` in the outbox; schedules a delivery unless one is."""
        loop = self._loop
        if not step.outputs or loop is None or loop.is_closed():
            return
        with self._lock:
            self._outbox.append(step)
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        # RuntimeError: the loop closed meanwhile, so nobody is left to deliver to.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._deliver)

    # ------------------------------------------------------------------ driver thread
    def _drive(self) -> None:
        engine = self.engine
        sent: dict[str, dict[int, int]] = {}  # request id -> sample index -> tokens delivered
        try:
            while True:
                self._wake.clear()
                with self._lock:
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    stopping = self._stopping
                step = StepOutputs(0.0)
                if stopping:
                    aborts = list(sent)
                for request_id in aborts:
                    if request_id in sent:
                        engine.abort(request_id)
                        self._collect(request_id, sent, step)
                aborted = set(aborts)
                for request_id, tokens, params in adds:
                    if request_id in aborted or stopping:
                        continue
                    try:  # checked by submit(); a failure here still must not stop the driver
                        engine.add_request(tokens, params, request_id)
                    except Exception as error:
                        step.outputs.append(_failed(request_id, tokens, error))
                        continue
                    sent[request_id] = {}
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception:  # the step's requests finished with error set
                        logger.exception("engine step failed")
                        outputs = [engine.get_output(rid) for rid in sent]
                        outputs = [o for o in outputs if o.finished]
                    for output in outputs:
                        self._add_delta(output, sent, step)
                self._publish(step)
                if stopping:
                    return
                if not engine.has_unfinished_requests():
                    self._wake.wait()
        except BaseException as error:
            self._error = error
            logger.exception("the engine driver stopped")
            self._fail_all(sent, error)
            raise

    def _collect(self, request_id: str, sent: dict, step: StepOutputs) -> None:
        self._add_delta(self.engine.get_output(request_id), sent, step)

    def _add_delta(self, output: RequestOutput, sent: dict, step: StepOutputs) -> None:
        """Turns a full snapshot into a delta (``new_token_ids`` since the last delivery) and
        forgets the request in the engine once it is finished."""
        counts = sent.get(output.request_id)
        if counts is None:
            return
        for sample in output.outputs:
            start = counts.get(sample.index, 0)
            sample.new_token_ids = sample.token_ids[start:]
            counts[sample.index] = len(sample.token_ids)
        if output.finished:
            del sent[output.request_id]
            self.engine.release(output.request_id)
        step.outputs.append(output)

    def _publish(self, step: StepOutputs) -> None:
        scheduler = self.engine.scheduler
        state = self.state
        state.num_running = len(scheduler.running)
        state.num_waiting = len(scheduler.waiting) + len(scheduler.swapped)
        state.blocks_in_use = self.engine.block_manager.num_used_blocks()
        step.time = time.perf_counter()
        if self.on_step is not None:
            self.on_step(state, step)
        self._send(step)

    def _fail_all(self, sent: dict, error: BaseException) -> None:
        """The driver is dying: every live request gets a finished output with the error."""
        step = StepOutputs(time.perf_counter())
        for request_id in list(sent):
            try:
                self.engine.abort(request_id)
                output = self.engine.get_output(request_id)
            except Exception:  # the engine itself is broken: nothing more to report
                continue
            if output.error is None:
                output.error = f"the engine stopped: {type(error).__name__}: {error}"
                output.error_is_internal = True
            step.outputs.append(output)
        self._send(step)


def _failed(request_id: str, tokens: list[int], error: Exception) -> RequestOutput:
    """The finished output of a request the engine refused to add."""
    now = time.perf_counter()
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        outputs=[],
        finished=True,
        error=f"{type(error).__name__}: {error}",
        metrics=RequestMetrics(now, None, None, now, len(tokens), 0, 0),
    )

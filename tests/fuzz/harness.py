"""The parent side of the fuzz harness: one long-lived worker process per target.

Starting an interpreter that imports torch costs seconds, so a worker (a ``spawn`` process:
no state inherited from pytest, no forked onnxruntime or OpenMP threads) serves every case of
its target. A worker that dies (a segfault, an abort) or does not answer within the time limit
turns the case into a ``crash``/``hang`` outcome and is replaced before the next case, so pytest
itself never dies with it.

Written by hand because ``concurrent.futures.ProcessPoolExecutor`` (and ``multiprocessing.Pool``)
can neither kill a task that hangs nor replace just the worker that crashed: a crash breaks the
whole pool, a hang blocks it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle

from tests.fuzz.worker import FuzzCase, Outcome, serve

# Address space a worker may map beyond what it holds after importing torch and onnxruntime:
# far above any fuzz case (tensors of a few KiB), far below an allocation sized by a bad length.
MEMORY_BYTES = 2 << 30
# Seconds one case may run (the machine is shared; a real case takes milliseconds).
CASE_TIMEOUT = float(os.environ.get("ATTNEXPORT_FUZZ_CASE_TIMEOUT", "60"))
START_TIMEOUT = 300.0


class WorkerDied(Exception):
    """The worker crashed or hung on a case; the message says which and how."""


class Worker:
    """Runs :class:`FuzzCase` objects on ``target`` in a child process."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=serve, args=(child, self.target, MEMORY_BYTES), daemon=True
        )
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT):
            process.kill()
            raise RuntimeError(f"fuzz worker for {self.target} did not start")
        parent.recv_bytes()
        self._process, self._connection = process, parent

    def run(self, case: FuzzCase) -> Outcome:
        """The target's outcome of ``case``; raises :class:`WorkerDied` on a crash or hang."""
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._connection.send_bytes(pickle.dumps(case))
            if self._connection.poll(CASE_TIMEOUT):
                return pickle.loads(self._connection.recv_bytes())
            self._process.kill()
            self._process.join()
            self._reset()
            raise WorkerDied(f"{self.target}: hang (no answer in {CASE_TIMEOUT:g} s)")
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._process.join(10)
            code = self._process.exitcode
            self._reset()
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise WorkerDied(f"{self.target}: crash ({how})") from None

    def _reset(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None

    def close(self) -> None:
        if self._process is not None:
            self._connection.close()
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
            self._reset()

"""uvicorn running the app, with a shutdown that answers every request it cut short.

uvicorn's graceful shutdown stops listening and waits ``timeout_graceful_shutdown`` seconds
for the open requests, then cancels them: a plain request gets a text/plain 500, a stream is
cut with neither an error event nor ``[DONE]``. :class:`DrainingServer` ends them first: when
``shutdown_timeout`` has passed it stops the engine, whose requests then end as aborted, so a
plain request is answered with an OpenAI-shaped 503 and a stream with an error event and
``data: [DONE]``; uvicorn's own deadline comes ``DRAIN_MARGIN`` seconds later, for what is
still left (a request whose engine step outlasts the margin).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

DRAIN_MARGIN = 5.0
"""Seconds between aborting the running requests and uvicorn cancelling what is left."""

logger = logging.getLogger("attnexport.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn server of an app from :func:`~attnexport.serve.app.create_app`.

    Args:
        app: the app.
        shutdown_timeout: seconds running requests get to finish once shutdown begins
            (SIGTERM, Ctrl-C, ``should_exit``); the rest are then aborted and answered.
        config_options: :class:`uvicorn.Config` keywords (host, port, log_level, ...).
    """

    def __init__(self, app: FastAPI, *, shutdown_timeout: float, **config_options) -> None:
        config = uvicorn.Config(
            app, timeout_graceful_shutdown=shutdown_timeout + DRAIN_MARGIN, **config_options
        )
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        server = getattr(app.state, "server", None)
        self._engine = server.engine if server is not None else None
        """The generation engine (None for an embeddings server: nothing to abort)."""

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _abort(self) -> None:
        if self._engine is None:
            return
        state = self._engine.state
        if state.num_running or state.num_waiting:
            logger.warning(
                "shutdown: %d running and %d waiting requests did not finish within "
                "--shutdown-timeout %g s; aborting them",
                state.num_running,
                state.num_waiting,
                self.shutdown_timeout,
            )
        self._engine.stop()

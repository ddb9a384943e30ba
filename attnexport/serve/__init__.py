"""An OpenAI-compatible HTTP server over the paged engine (``attnexport serve``).

* ``async_engine``: :class:`AsyncEngine`, one driver thread stepping the engine and an async
  stream per request;
* ``protocol``: the OpenAI request and response bodies (pydantic);
* ``served_model``: the artifact's engine, tokenizer and generation defaults;
* ``stop``: stop strings over streamed text;
* ``errors``: OpenAI-shaped errors;
* ``metrics``: the Prometheus metrics of ``/metrics``;
* ``app``: ``create_app``, the FastAPI routes.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client); imports no torch when the
artifact is served by onnxruntime.
"""

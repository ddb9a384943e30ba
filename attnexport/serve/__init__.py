"""An OpenAI-compatible HTTP server over the paged engine (``attnexport serve``).

| module | job |
|---|---|
| ``async_engine`` | :class:`AsyncEngine`: one driver thread steps the engine, each request gets an async stream |
| ``protocol`` | the OpenAI request and response bodies (pydantic) |
| ``served_model`` | the artifact's engine, tokenizer and generation defaults |
| ``stop`` | stop strings over streamed text |
| ``errors`` | OpenAI-shaped errors |
| ``metrics`` | the Prometheus metrics of ``/metrics`` |
| ``app`` | :func:`create_app`: the FastAPI routes |

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client); imports no torch when the
artifact is served by onnxruntime.
"""

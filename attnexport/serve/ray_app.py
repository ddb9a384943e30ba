"""Scale-out on Ray Serve: N replicas of the server, one engine each, behind Ray's HTTP proxy.

    import ray
    from ray import serve
    from attnexport.serve.ray_app import ray_application

    ray.init()
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(ray_application("out/llama", num_replicas=2), route_prefix="/")

Each replica is a Ray actor that builds the app of :func:`~attnexport.serve.app.create_app`
over its own copy of the artifact (the same routes, errors and metrics as ``attnexport
serve``); Ray's proxy routes each request to the replica with the shortest queue (power of two
choices). Responses carry the answering replica in ``system_fingerprint``. Needs the ``ray``
extra (``ray[serve]``).
"""

from __future__ import annotations

import os


def _build(artifact: str, max_queued_requests: int | None, model_options: dict):
    """The ASGI app of one replica (runs in the replica's process)."""
    from attnexport.serve.app import create_app
    from attnexport.serve.served_model import load_served_model

    return create_app(
        load_served_model(artifact, **model_options), max_queued_requests=max_queued_requests
    )


def ray_application(
    artifact: str | os.PathLike,
    *,
    num_replicas: int = 2,
    num_cpus_per_replica: float = 1.0,
    max_ongoing_requests: int = 256,
    max_queued_requests: int | None = 256,
    **model_options,
):
    """A Ray Serve application of ``num_replicas`` servers of ``artifact``.

    Args:
        artifact: an export directory, ``model.onnx`` or ``model.pt2``, at the same path on
            every node.
        num_replicas: engine replicas (each holds its own KV pool).
        num_cpus_per_replica: the CPUs Ray reserves for each replica.
        max_ongoing_requests: requests Ray sends one replica at a time; more wait in Ray's
            router. Keep it at least the engine's ``max_num_seqs`` so its batches fill.
        max_queued_requests: the replica's own waiting queue (503 past it), as
            ``attnexport serve --max-queued-requests``.
        model_options: :func:`~attnexport.serve.served_model.load_served_model` keywords
            (``max_num_seqs``, ``kv_cache_bytes``, ``num_threads``, ...).

    Returns:
        The bound application, for ``serve.run``.
    """
    from attnexport.errors import require

    require("ray", "ray", "the Ray Serve deployment")
    from ray import serve

    artifact = str(artifact)

    def builder():  # a function: Ray calls it on each replica (a partial would be taken as ASGI)
        return _build(artifact, max_queued_requests, model_options)

    deployment = serve.deployment(
        serve.ingress(builder)(),
        name="attnexport",
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus_per_replica},
    )
    return deployment.bind()

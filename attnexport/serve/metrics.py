"""``GET /metrics``: the server's Prometheus metrics (prometheus_client), one registry per app.

Gauges are set by the engine's driver thread after each iteration; counters and latency
histograms are observed on the event loop as outputs reach their requests. prometheus_client's
metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from attnexport.serve.async_engine import EngineState, StepOutputs

# Seconds: sub-millisecond steps of a tiny model up to long queues of a large one.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    """The metrics of one server (``registry`` is what ``/metrics`` exposes)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        self.requests_running = gauge(
            "attnexport_requests_running", "Requests with samples running in the engine."
        )
        self.requests_waiting = gauge(
            "attnexport_requests_waiting",
            "Requests waiting for a slot (queued, or preempted and swapped out).",
        )
        self.kv_blocks_in_use = gauge(
            "attnexport_kv_blocks_in_use", "KV-cache blocks of the device pool in use."
        )
        self.kv_blocks_total = gauge(
            "attnexport_kv_blocks_total", "KV-cache blocks of the device pool."
        )
        self.kv_bytes_in_use = gauge(
            "attnexport_kv_bytes_in_use", "Bytes of the KV-cache blocks in use."
        )
        self.prompt_tokens = Counter(
            "attnexport_prompt_tokens", "Prompt tokens of the requests admitted.", labels,
            registry=self.registry,
        ).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter(
            "attnexport_generation_tokens", "Tokens generated.", labels, registry=self.registry
        ).labels(model_name)
        self._finished = Counter(
            "attnexport_requests_finished",
            "Requests finished, by the engine's finish reason: stop, length, error, aborted "
            "(a client that went away, a stop string that ended every sample, a shutdown).",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "attnexport_requests_rejected",
            "Requests refused: bad payloads (400) and a full queue (503).",
            [*labels, "status"],
            registry=self.registry,
        )

        def latency(name: str, documentation: str):
            histogram = Histogram(
                name, documentation, labels, buckets=LATENCY_BUCKETS, registry=self.registry
            )
            return histogram.labels(model_name)

        self.time_to_first_token = latency(
            "attnexport_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
        )
        self.inter_token_latency = latency(
            "attnexport_inter_token_latency_seconds",
            "Seconds between consecutive outputs of a request's tokens.",
        )
        self.request_latency = latency(
            "attnexport_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token.",
        )
        self.model_name = model_name
        self.bytes_per_block = 0

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def on_step(self, state: EngineState, step: StepOutputs) -> None:
        """The driver's state after an iteration, and the requests it finished, by the
        engine's finish reason (driver thread)."""
        for output in step.outputs if step is not None else ():
            if output.finished:
                self.finished(output.finish_reason or "aborted")
        self.requests_running.set(state.num_running)
        self.requests_waiting.set(state.num_waiting)
        self.kv_blocks_in_use.set(state.blocks_in_use)
        self.kv_blocks_total.set(state.num_blocks)
        self.kv_bytes_in_use.set(state.blocks_in_use * self.bytes_per_block)

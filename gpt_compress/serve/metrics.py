"""Prometheus metrics of the server (``GET /metrics``), in a registry of their own so that two
servers in one process (tests) do not collide."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The server's counters, gauges and histograms."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gptc_http_requests", "HTTP requests to /v1 endpoints by status code",
                                ["endpoint", "status"], registry=r)
        self.engine_requests = Counter("gptc_engine_requests", "Sequences leaving the engine by outcome "
                                       "(ok, cancelled, error_500, error_504, ...)", ["status"], registry=r)
        self.prompt_tokens = Counter("gptc_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("gptc_generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("gptc_speculative_draft_tokens", "Draft tokens checked by verify steps "
                                    "(prompt lookup or the draft model)", registry=r)
        self.accepted_tokens = Counter("gptc_speculative_accepted_tokens", "Draft tokens kept (acceptance "
                                       "rate: this over gptc_speculative_draft_tokens)", registry=r)
        self.spec_steps = Counter("gptc_speculative_steps", "Request steps that checked draft tokens (each "
                                  "gives its kept drafts and one token of the model's)", registry=r)
        self.acceptance_rate = Gauge("gptc_speculative_acceptance_rate", "Draft tokens kept over draft tokens "
                                     "checked, since the start", registry=r)
        self.tokens_per_step = Gauge("gptc_speculative_tokens_per_step", "Tokens a request gains per step that "
                                     "checked drafts, since the start (1 without speculation: the speed-up in "
                                     "model steps)", registry=r)
        self.draft_seconds = Counter("gptc_speculative_draft_seconds", "Seconds the draft model ran "
                                     "(its cost against the saved steps)", registry=r)
        self.queue_depth = Gauge("gptc_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("gptc_running_batch_size", "Sequences in the running decode batch", registry=r)
        self.batch_size = Histogram("gptc_decode_batch_size", "Sequences per decode step", registry=r,
                                    buckets=BATCH_BUCKETS)
        self.ttft = Histogram("gptc_time_to_first_token_seconds", "Submission to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("gptc_inter_token_latency_seconds", "Time between two tokens of a request",
                             registry=r, buckets=LATENCY_BUCKETS)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

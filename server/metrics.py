"""/metrics in Prometheus' text format, from the official client library (prometheus-client).

The server's own registry (not the library's process-wide default), so two servers in one
process, as the tests start them, never share a count. Counters and histograms are updated on
the model's thread as tokens come out; the gauges (rows, queue, blocks) are read from the worker
when Prometheus scrapes.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few ms (a token of a small model) to minutes (a long queue).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class Metrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model}

        def counter(name: str, doc: str, *names: str) -> Counter:
            return Counter(name, doc, ["model", *names], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=self.registry).labels(**labels)

        self.requests = counter("beacon_requests", "Requests answered, by how they ended", "finish_reason")
        self.prompt_tokens = counter("beacon_prompt_tokens", "Prompt tokens of the requests admitted").labels(**labels)
        self.generated_tokens = counter("beacon_generation_tokens", "Tokens generated").labels(**labels)
        self.prefix_hits = counter("beacon_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache, not prefilled").labels(**labels)
        self.ttft = Histogram("beacon_time_to_first_token_seconds", "From a request's arrival to its first token", ["model"], buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.inter_token = Histogram("beacon_inter_token_latency_seconds", "Between two tokens of one answer", ["model"], buckets=INTER_TOKEN_BUCKETS, registry=self.registry).labels(**labels)
        self.running = gauge("beacon_requests_running", "Requests holding a row of the batch")
        self.waiting = gauge("beacon_requests_waiting", "Requests waiting for a row")
        self.blocks_used = gauge("beacon_kv_blocks_used", "Blocks of the paged KV pool in use")
        self.blocks_total = gauge("beacon_kv_blocks", "Blocks of the paged KV pool")
        self.model = model

    def finished(self, finish_reason: str) -> None:
        self.requests.labels(model=self.model, finish_reason=finish_reason).inc()

    def scrape(self, stats: dict) -> bytes:
        """The text format, with the gauges set from the worker's stats."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.blocks_used.set(stats["pool_blocks"] - stats["free_blocks"])
        self.blocks_total.set(stats["pool_blocks"])
        return generate_latest(self.registry)

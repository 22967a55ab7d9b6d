"""Prometheus metrics through prometheus_client, for `asyncllm serve` and for apps that embed the engine.

    metrics = EngineMetrics(engine, "my-model")          # its own registry, with process metrics
    metrics = EngineMetrics(engine, "my-model", registry=prometheus_client.REGISTRY)  # into the app's
    ...
    metrics.observe_request(stream, stream.finish_reason or "abort")   # as each request ends
    body, content_type = metrics.render()                               # a /metrics response

EngineCollector reads engine.stats() when scraped (gauges, and the engine's own counters), so the
engine keeps no Prometheus objects and never imports this module; RequestMetricsRecorder keeps the
request-level counters and histograms, fed from each stream's RequestMetrics as it ends. Every
metric carries a model_name label; the names are the ones the hand-written text had.
"""
from __future__ import annotations

import bisect
import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """The engine's state, read from engine.stats() at each scrape: register it into any
    CollectorRegistry (`registry.register(EngineCollector(engine, "my-model"))`)."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        labels = [self.model_name]
        total = stats.get("num_total_blocks", 0)
        in_use = total - stats.get("num_free_blocks", 0)

        def family(kind, name: str, help_text: str, value):
            metric = kind(name, help_text, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "asyncllm_num_requests_waiting", "Requests queued in the scheduler, not yet running.",
                     stats.get("num_waiting", 0))
        yield family(gauge, "asyncllm_num_pending_commands",
                     "Submissions and aborts not yet taken in by the engine thread.", stats.get("num_inbox", 0))
        yield family(gauge, "asyncllm_num_requests_running", "Requests being generated.", stats.get("num_running", 0))
        yield family(gauge, "asyncllm_kv_blocks_in_use", "KV-cache blocks held by requests.", in_use)
        yield family(gauge, "asyncllm_kv_blocks_total", "KV-cache blocks in all.", total)
        yield family(gauge, "asyncllm_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use.",
                     in_use / total if total else 0.0)
        yield family(gauge, "asyncllm_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
                     float(stats.get("prefix_cache_hit_rate", 0.0)))
        yield family(gauge, "asyncllm_grammar_compiles_queued", "Grammar compiles waiting for a compile thread.",
                     stats.get("grammar_compiles_queued", 0))
        yield family(gauge, "asyncllm_grammar_compiles_running", "Grammar compiles running for a waiting request.",
                     stats.get("grammar_compiles_running", 0))
        yield family(gauge, "asyncllm_grammar_compiles_detached",
                     "Grammar compiles running on after their requests left or timed out (bounded).",
                     stats.get("grammar_compiles_detached", 0))
        yield family(gauge, "asyncllm_grammar_cache_bytes", "Memory held by cached compiled grammars.",
                     stats.get("grammar_cache_bytes", 0))
        # counters: the *_total sample names are what the hand-written text had
        yield family(counter, "asyncllm_num_preemptions", "Requests preempted for lack of KV blocks.",
                     stats.get("num_preemptions", 0))
        yield family(counter, "asyncllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats.get("prefix_cache_queries", 0))
        yield family(counter, "asyncllm_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     stats.get("prefix_cache_hits", 0))
        if "spec_draft_tokens" in stats:  # speculative decoding is on (Config.speculative_config)
            yield family(counter, "asyncllm_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).",
                         stats["spec_draft_tokens"])
            yield family(counter, "asyncllm_spec_decode_accepted_tokens", "Draft tokens accepted.",
                         stats["spec_accepted_tokens"])
            yield family(counter, "asyncllm_spec_decode_verifications", "Request steps that verified drafts.",
                         stats["spec_verifications"])
            yield family(gauge, "asyncllm_spec_decode_acceptance_rate", "Accepted draft tokens per draft token.",
                         stats["spec_acceptance_rate"])
            yield family(gauge, "asyncllm_spec_decode_mean_accepted_length",
                         "Tokens a verifying request takes per step (accepted drafts + 1).",
                         stats["spec_mean_accepted_length"])
            yield family(gauge, "asyncllm_spec_decode_speculating_share",
                         "Decoding requests' steps that verified drafts, per decoding request step.",
                         stats["spec_speculating_share"])


class BulkHistogram(Collector):
    """A histogram with one label, model_name, fed many values at once (observe_all): a request's
    inter-token gaps, one per token it streamed. prometheus_client's Histogram.observe walks the
    buckets in Python and takes two locks per value, a few microseconds per token on the event
    loop; here a value costs one bisect, and the lock is taken once per call."""

    def __init__(self, name: str, help_text: str, model_name: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        self.name, self.help_text, self.model_name = name, help_text, model_name
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_all(self, values) -> None:
        bounds, counts = self.bounds, self.counts
        indices = [bisect.bisect_left(bounds, v) for v in values]  # a bucket's bound is inclusive (le)
        with self._lock:
            for i in indices:
                counts[i] += 1
            self.sum += sum(values)

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, INF), counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.help_text, labels=["model_name"])
        family.add_metric([self.model_name], buckets, total)
        yield family


class RequestMetricsRecorder:
    """Request-level counters and histograms in `registry`, fed as requests end or are refused."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        def labelled(metric_type, name: str, help_text: str, **kwargs):
            return metric_type(name, help_text, ["model_name"], registry=registry, **kwargs).labels(model_name)

        self.ttft = labelled(Histogram, "asyncllm_time_to_first_token_seconds", "Time from arrival to the first token.",
                             buckets=TTFT_BUCKETS)
        self.itl = BulkHistogram("asyncllm_inter_token_latency_seconds", "Time between a request's token deliveries.",
                                 model_name, ITL_BUCKETS, registry)
        self.e2e = labelled(Histogram, "asyncllm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                            buckets=E2E_BUCKETS)
        self.queue_time = labelled(Histogram, "asyncllm_request_queue_time_seconds",
                                   "Time from arrival to first being scheduled.", buckets=QUEUE_BUCKETS)
        self.prompt_tokens = labelled(Counter, "asyncllm_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = labelled(Counter, "asyncllm_generation_tokens", "Tokens generated for finished requests.")
        finished = Counter("asyncllm_requests", "Finished requests by finish reason.", ["model_name", "finish_reason"],
                           registry=registry)
        self.finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}
        self._finished_family = finished
        self._rejected = Counter("asyncllm_requests_rejected", "Requests refused before generation, by HTTP status.",
                                 ["model_name", "status"], registry=registry)
        self.model_name = model_name

    def observe_request(self, stream, finish_reason: str) -> None:
        """Record a request that ended (stream: a RequestStream, finished or aborted)."""
        counter = self.finished.get(finish_reason)
        if counter is None:
            counter = self.finished[finish_reason] = self._finished_family.labels(self.model_name, finish_reason)
        counter.inc()
        self.prompt_tokens.inc(len(stream.prompt_token_ids))
        self.generation_tokens.inc(stream.num_completion_tokens)  # all n sequences' tokens
        m = stream.metrics
        if m is None:
            return
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        self.itl.observe_all(list(m.inter_token_latencies))
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)

    def observe_rejection(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()


class EngineMetrics(RequestMetricsRecorder):
    """An engine's metrics, ready to serve: EngineCollector and the request-level metrics in one
    registry. Without a registry, a new one that also has the process, GC and platform collectors
    (prometheus_client's default registry has those already, so they are not added to a given one)."""

    def __init__(self, engine, model_name: str, registry: CollectorRegistry | None = None):
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            GCCollector(registry=registry)
            PlatformCollector(registry=registry)
        self.registry = registry
        super().__init__(model_name, registry)
        registry.register(EngineCollector(engine, model_name))

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

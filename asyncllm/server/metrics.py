"""Prometheus metrics: the engine's gauges and request-level counters and histograms, as text.

prometheus_client is not a dependency of this project (and not installed where it runs), so the
few histograms it needs are written here.
"""
from __future__ import annotations

import bisect
import threading


class _Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, out: list[str]) -> None:
        out += [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum!r}")
        out.append(f"{self.name}_count {self.count}")


class ServerMetrics:
    """Request-level metrics, fed as requests end, rendered with the engine's gauges."""

    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = _Histogram("asyncllm_time_to_first_token_seconds", "Time from arrival to the first token.",
                               (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                7.5, 10.0, 20.0, 40.0, 80.0))
        self.itl = _Histogram("asyncllm_inter_token_latency_seconds", "Time between a request's token deliveries.",
                              (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0))
        self.e2e = _Histogram("asyncllm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                              (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0))
        self.finished = dict.fromkeys(self.FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected: dict[int, int] = {}

    def observe_request(self, stream, finish_reason: str) -> None:
        m = stream.metrics
        with self._lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += len(stream.prompt_token_ids)
            self.generation_tokens += len(stream.token_ids)
            if m is None:
                return
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            for gap in list(m.inter_token_latencies):
                self.itl.observe(gap)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)

    def observe_rejection(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def render(self, stats: dict) -> str:
        out: list[str] = []

        def gauge(name: str, help_text: str, value, kind: str = "gauge") -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        total = stats.get("num_total_blocks", 0)
        gauge("asyncllm_num_requests_waiting", "Requests queued in the scheduler, not yet running.",
              stats.get("num_waiting", 0))
        gauge("asyncllm_num_pending_commands", "Submissions and aborts not yet taken in by the engine thread.",
              stats.get("num_inbox", 0))
        gauge("asyncllm_num_requests_running", "Requests being generated.", stats.get("num_running", 0))
        gauge("asyncllm_kv_blocks_in_use", "KV-cache blocks held by requests.", total - stats.get("num_free_blocks", 0))
        gauge("asyncllm_kv_blocks_total", "KV-cache blocks in all.", total)
        gauge("asyncllm_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use.",
              (total - stats.get("num_free_blocks", 0)) / total if total else 0.0)
        gauge("asyncllm_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
              float(stats.get("prefix_cache_hit_rate", 0.0)))
        gauge("asyncllm_num_preemptions_total", "Requests preempted for lack of KV blocks.",
              stats.get("num_preemptions", 0), "counter")
        with self._lock:
            out += ["# HELP asyncllm_requests_total Finished requests by finish reason.",
                    "# TYPE asyncllm_requests_total counter"]
            out += [f'asyncllm_requests_total{{finish_reason="{r}"}} {n}' for r, n in self.finished.items()]
            out += ["# HELP asyncllm_requests_rejected_total Requests refused before generation, by HTTP status.",
                    "# TYPE asyncllm_requests_rejected_total counter"]
            out += [f'asyncllm_requests_rejected_total{{status="{s}"}} {n}' for s, n in sorted(self.rejected.items())]
            gauge("asyncllm_prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens, "counter")
            gauge("asyncllm_generation_tokens_total", "Tokens generated for finished requests.",
                  self.generation_tokens, "counter")
            for histogram in (self.ttft, self.itl, self.e2e):
                histogram.render(out)
        return "\n".join(out) + "\n"

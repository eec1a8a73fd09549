"""`/metrics`: vLLM's metric names where one applies (requests running and waiting, time
to first token, inter-token latency, end-to-end latency, prompt and generation tokens),
and offloading's own: bytes streamed, copy stall time, disk reads, forwards. One registry
per server, so that several can live in one process."""

from __future__ import annotations

import sys
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from offload.engine import step_jobs

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class ServerMetrics:
    def __init__(self, model_name: str, engine, stats: Callable[[], object]):
        """`engine`: the batching engine (its queue sizes); `stats()`: the LLM's
        `TransferStats`, read at each scrape."""
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, text: str, read: Callable[[], float]) -> None:
            Gauge(name, text, list(labels), registry=registry).labels(**labels).set_function(read)

        gauge(
            "vllm:num_requests_running",
            "Requests in the running batch.",
            lambda: engine.num_running,
        )
        gauge("vllm:num_requests_waiting", "Requests waiting to run.", lambda: engine.num_waiting)
        # Offloading's totals only grow: Prometheus counters (`_total` is a counter's
        # suffix), read from the LLM's stats at each scrape.
        registry.register(
            _Totals(
                labels,
                stats,
                (
                    ("offload:weight_bytes_copied",
                     "Offloaded weight bytes copied to the compute device so far.",
                     lambda now: now.weight_copied_bytes),
                    ("offload:disk_bytes_read",
                     "Weight bytes read from the checkpoint's files by the disk tier.",
                     lambda now: now.disk_read_bytes),
                    ("offload:kv_bytes_moved", "KV cache bytes moved between host and device "
                     "memory.", lambda now: now.kv_moved_bytes),
                    ("offload:stall_seconds", "Seconds compute waited for weight copies and "
                     "reads.", lambda now: now.stall_s + now.disk_stall_s),
                    ("offload:forwards", "Model forwards run.", lambda now: now.num_forwards),
                    ("offload:compiled_steps", "Decode steps run by a compiled step.",
                     lambda now: now.num_compiled_steps),
                    ("vllm:spec_decode_num_drafts", "Speculative decoding: a sequence's "
                     "guesses scored.", lambda now: now.num_spec_drafts),
                    ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens "
                     "guessed.", lambda now: now.num_spec_draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: guessed "
                     "tokens the model picked itself.", lambda now: now.num_spec_accepted_tokens),
                ),
            )
        )  # fmt: skip
        # Graphs dynamo traced in this process (a launch that loads its kept steps: none).
        registry.register(
            _Totals(labels, lambda: None, (("offload:dynamo_graphs_compiled", "Graphs "
                    "torch.compile traced in this process.", lambda _: _dynamo_graphs()),))
        )  # fmt: skip
        # Prefix caching, in prompt tokens (vLLM V1's counters, and V0's hit-rate gauge).
        registry.register(
            _Totals(
                labels,
                lambda: engine.scheduler.prefixes,
                (
                    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                     "cache.", lambda held: held.queries if held is not None else 0),
                    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda held: held.hits if held is not None else 0),
                ),
            )
        )  # fmt: skip
        # Preemption where the rows outgrow the KV room (`Scheduler.make_room`).
        registry.register(
            _Totals(labels, lambda: engine.scheduler, (("vllm:num_preemptions", "Requests "
                    "preempted for KV cache room (and recomputed).",
                    lambda scheduler: scheduler.num_preemptions),))
        )  # fmt: skip
        gauge(
            "offload:step_jobs_pending",
            "1 while a compiled step loads or compiles in the background (steps meanwhile "
            "run eagerly, and prompts ride in them less), else 0.",
            lambda: float(step_jobs.busy()),
        )
        gauge(
            "vllm:kv_cache_usage_perc",
            "The part of the KV room the rows hold memory for (1 = full).",
            lambda: engine.scheduler.kv_usage,
        )
        gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache, of those looked up.",
            lambda: _hit_rate(engine.scheduler.prefixes),
        )

        def histogram(name: str, text: str):
            return Histogram(
                name, text, list(labels), buckets=_LATENCY_BUCKETS, registry=registry
            ).labels(**labels)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first token."
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens of a request."
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last token."
        )

        def counter(name: str, text: str):
            return Counter(name, text, list(labels), registry=registry).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = counter("vllm:request_success", "Requests finished.")
        self.request_failure = counter("offload:request_failure", "Requests ended by an error.")

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _dynamo_graphs() -> int:
    """(Without importing dynamo: a process that never imported it compiled nothing.)"""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def _hit_rate(held) -> float:
    return held.hits / held.queries if held is not None and held.queries else 0.0


class _Totals(Collector):
    """Counters whose values the LLM or the engine keeps: (name, help, read(stats)) each,
    one read of the stats a scrape."""

    def __init__(self, labels: dict[str, str], stats: Callable[[], object], totals: tuple):
        self._labels, self._stats, self._totals = labels, stats, totals

    def collect(self):
        now = self._stats()
        for name, text, read in self._totals:
            family = CounterMetricFamily(name, text, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), read(now))
            yield family

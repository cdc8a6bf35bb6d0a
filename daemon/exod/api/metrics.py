"""Prometheus metrics of the daemon (prometheus-client).

State gauges are read from the machines at scrape time (a collector), so they
can never drift from the truth; counters and histograms are bumped where the
thing happens. One registry per daemon, not the process-global one, so that
two daemons in one test process do not mix.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import fsm
from exod import generated as g

if TYPE_CHECKING:
    from exod.controller import Controller


UNPLACED = "(not placed)"  # the one label of every model a client named that is not placed


class Metrics:
    def __init__(self, controller: Controller, malformed: Tally[str] | None = None) -> None:
        """``malformed``: in a cluster, the values read from etcd that were skipped as not exod's, by kind."""
        self._controller = controller
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "exod_requests", "Chat completion requests by outcome", ["model", "outcome"], registry=self.registry
        )
        self.latency = Histogram(
            "exod_request_seconds",
            "Chat completion latency, request to last token",
            ["model"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.tokens = Counter("exod_tokens_generated", "Completion tokens generated", ["model"], registry=self.registry)
        self.embedded = Counter(
            "exod_embedding_inputs", "Inputs embedded (each an embedding)", ["model"], registry=self.registry
        )
        self.embedded_tokens = Counter(
            "exod_embedding_tokens", "Tokens read to make embeddings", ["model"], registry=self.registry
        )
        self.batch_size = Histogram(
            "exod_batch_size",
            "Requests decoded together: per finished request, the most that shared its runner's batch",
            ["model"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=self.registry,
        )
        self.embedding_batch_size = Histogram(
            "exod_embedding_batch_size",
            "Inputs embedded together: per input embedded, how many shared its forward pass",
            ["model"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "exod_prompt_cache_hits", "Requests whose prompt began with a cached one", ["model"], registry=self.registry
        )
        self.cache_tokens = Counter(
            "exod_prompt_cache_tokens", "Prompt tokens read from the prompt cache", ["model"], registry=self.registry
        )
        self.cache_bytes = Gauge(
            "exod_prompt_cache_bytes",
            "KV bytes rank 0's prompt cache held at its last finish",
            ["model"],
            registry=self.registry,
        )
        self.cold_starts = Histogram(
            "exod_cold_start_seconds",
            "Requests that waited for their instance to load (unparked, or placed on demand): the wait",
            ["model"],
            buckets=(0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(controller))
        if malformed is not None:
            self.registry.register(_MalformedCollector(malformed))

    def label(self, model: str) -> str:
        """A model's label: its name if placed, else one label for all: a client chooses the name, and every
        distinct label is a series kept for good (60k made-up names were +90 MiB and a 31 MB /metrics)."""
        return model if model in self._controller.placed_models() else UNPLACED

    def finished(self, model: str, done: g.Done, *, embedded: bool = False) -> None:
        """One generation ended (``embedded``: an input's embedding): how it was batched, what the prompt cache
        gave it."""
        model = self.label(model)
        (self.embedding_batch_size if embedded else self.batch_size).labels(model).observe(done.batch_size)
        if done.cached_tokens:
            self.cache_hits.labels(model).inc()
            self.cache_tokens.labels(model).inc(done.cached_tokens)
        self.cache_bytes.labels(model).set(done.prompt_cache_bytes)


class _MalformedCollector(Collector):
    def __init__(self, malformed: Tally[str]) -> None:
        self.malformed = malformed

    def collect(self) -> Iterator[CounterMetricFamily]:
        skipped = CounterMetricFamily(
            "exod_etcd_values_skipped", "Values read from etcd and skipped as not exod's, by kind", labels=["kind"]
        )
        for kind in ("node", "runner", "snapshot"):
            skipped.add_metric([kind], self.malformed.get(kind, 0))
        yield skipped


class _StateCollector(Collector):
    """Gauges from the status document, read at scrape time."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.controller.status()["instances"]
        stopped = fsm.RunnerPhase.STOPPED.value
        runners = GaugeMetricFamily("exod_runners", "Runner processes by lifecycle state", labels=["state"])
        by_state = Tally(
            r["state"] for i in status for r in i["runners"] if r["state"] is not None and r["phase"] != stopped
        )
        for state in fsm.RunnerState:
            runners.add_metric([state.value], by_state.get(state.value, 0))
        yield runners
        instances = GaugeMetricFamily("exod_instances", "Instances by retry-policy state", labels=["state"])
        by_instance = Tally(i["state"] for i in status)
        for state in fsm.InstanceState:
            instances.add_metric([state.value], by_instance.get(state.value, 0))
        yield instances
        attempts = GaugeMetricFamily(
            "exod_instance_retries", "Failed generations counted against each instance's budget", labels=["instance"]
        )
        for i in status:
            attempts.add_metric([i["instance_id"]], i["attempts"])
        yield attempts
        parks = CounterMetricFamily(
            "exod_parks",
            "Instances parked since start, by reason (idle, evicted: for another's memory, requested)",
            labels=["reason"],
        )
        tally = self.controller.residency_counts
        for reason in fsm.ParkReason:
            parks.add_metric([reason.value], tally.get(("park", reason.value), 0))
        yield parks
        yield CounterMetricFamily("exod_unparks", "Parked instances brought back since start", tally[("unpark", "")])
        sequences = GaugeMetricFamily(
            "exod_max_sequences",
            "Sequences each instance's runners decode at once (sized from kv_cache_mib and the model, unless set; "
            "`exod status` says why)",
            labels=["instance"],
        )
        for i in status:
            if i.get("batch") is not None:
                sequences.add_metric([i["instance_id"]], i["batch"]["max_sequences"])
        yield sequences
        residency = GaugeMetricFamily("exod_instance_residency", "Instances by residency", labels=["residency"])
        by_residency = Tally(i.get("residency") for i in status)
        for where in fsm.Residency:
            residency.add_metric([where.value], by_residency.get(where.value, 0))
        yield residency
        failures = CounterMetricFamily("exod_runner_failures", "Runner failures since start, by cause", labels=["kind"])
        counts = self.controller.failure_counts
        for kind in fsm.FailureKind:
            failures.add_metric([kind.value], counts.get(kind.value, 0))
        yield failures

"""Prometheus metrics of multi-LoRA decisions, in a registry the user can pass."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from acelora.trace import TraceEvent

_MS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000)


class Metrics:
    """Counters and histograms fed by every recorded :class:`TraceEvent`.

    >>> m = Metrics(); m.observe(TraceEvent(mode="prod", action="fallback_base_model")); b"acelora" in m.render()
    True
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple[str, str, str], Any] = {}
        self.requests = Counter(
            "acelora_multi_lora_requests",
            "Multi-LoRA decisions by mode, action and fallback reason.",
            ["mode", "action", "fallback_reason"],
            registry=self.registry,
        )
        self.swap_ms = Histogram(
            "acelora_multi_lora_swap_ms",
            "Milliseconds a request waited for its adapter to become resident.",
            buckets=_MS_BUCKETS,
            registry=self.registry,
        )
        self.overhead_ms = Histogram(
            "acelora_multi_lora_overhead_ms",
            "Milliseconds acelora added to a request (routing and body rewrite).",
            buckets=_MS_BUCKETS,
            registry=self.registry,
        )

    def observe(self, event: TraceEvent) -> None:
        key = (event.mode, event.action, event.fallback_reason or "")
        child = self._children.get(key)
        if child is None:  # .labels() costs a few µs per call; the label sets are few
            child = self._children[key] = self.requests.labels(*key)
        child.inc()
        if event.swap_ms is not None:
            self.swap_ms.observe(event.swap_ms)
        if event.overhead_ms is not None:
            self.overhead_ms.observe(event.overhead_ms)

    def render(self) -> bytes:
        """The text exposition format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)

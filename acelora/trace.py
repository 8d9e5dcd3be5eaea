"""Traces of every multi-LoRA decision: the event, its header codec, and a bounded recorder."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from operator import attrgetter
from typing import Any
from urllib.parse import quote, unquote

log = logging.getLogger("acelora.trace")

TRACE_HEADER = "x-ace-trace-multi-lora"
SERVED_BY_HEADER = "x-ace-served-by"

# Actions (DESIGN.md, "Modes").
WOULD_LOAD = "would_load_lora"
PREFETCHED_APPLIED = "adapter_prefetched_applied"
COLD_LOADED_APPLIED = "adapter_cold_loaded_applied"
FALLBACK = "fallback_base_model"
REJECTED = "rejected"


@dataclass(slots=True)
class TraceEvent:
    """One multi-LoRA decision as it was applied; every figure is measured or derived from sizes.

    >>> TraceEvent(mode="prod", action="fallback_base_model", fallback_reason="unknown_adapter").action
    'fallback_base_model'
    """

    mode: str
    action: str
    adapter_name: str | None = None
    adapter_hash: str | None = None
    tenant_id: str | None = None
    served_by: str | None = None
    is_prefetch_hit: bool | None = None
    resident: bool | None = None
    swap_ms: float | None = None
    swap_ms_saved: float | None = None
    vram_mb_saved: float | None = None
    fallback_reason: str | None = None
    overhead_ms: float | None = None
    request_id: str | None = None
    timestamp: float = field(default_factory=time.time)
    skill: str = "multi_lora"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``trace`` entries of ``/v1/execute``)."""
        return asdict(self)


_KINDS: dict[str, type] = {
    f.name: (bool if "bool" in str(f.type) else float if "float" in str(f.type) else str) for f in fields(TraceEvent)
}
_TO_HEADER = {"adapter_name": "adapter"}
_FROM_HEADER = {v: k for k, v in _TO_HEADER.items()}
# Everything else is percent-encoded, so CR, LF, ',' and '=' can never appear raw in the header.
_SAFE = "._-:/"


_NAMES = tuple(name for name in _KINDS if name != "skill")
_KEYS = tuple(_TO_HEADER.get(n, n) + "=" for n in _NAMES)
_values = attrgetter(*_NAMES)  # one C call fetches every field
_quoted: dict[str, str] = {}  # percent-encoded forms of the few strings that recur (modes, actions, names)


def encode_header(event: TraceEvent) -> str:
    """The ``x-ace-trace-multi-lora`` value: ``mode=prod,action=...,adapter=...`` (``None`` fields omitted).

    >>> encode_header(TraceEvent(mode="shadow", action="would_load_lora", timestamp=1.5))
    'mode=shadow,action=would_load_lora,timestamp=1.5'
    """
    parts = []
    for key, value in zip(_KEYS, _values(event), strict=True):
        if value is None:
            continue
        if value is True or value is False:
            parts.append(key + ("true" if value else "false"))
        elif isinstance(value, float):
            parts.append(key + repr(value))
        else:
            text = str(value)
            q = _quoted.get(text)
            if q is None:
                if len(_quoted) > 4096:  # client-chosen strings must not grow it forever
                    _quoted.clear()
                q = _quoted[text] = quote(text, safe=_SAFE)
            parts.append(key + q)
    return ",".join(parts)


def decode_header(value: str) -> TraceEvent:
    """Inverse of :func:`encode_header`; unknown keys are ignored, malformed values raise ValueError.

    >>> decode_header("mode=prod,action=fallback_base_model,fallback_reason=unknown_adapter").fallback_reason
    'unknown_adapter'
    """
    kwargs: dict[str, Any] = {}
    for part in value.split(","):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"trace header part {part[:40]!r} is not key=value")
        name = _FROM_HEADER.get(key, key)
        kind = _KINDS.get(name)
        if kind is None or name == "skill":
            continue
        if kind is bool:
            if raw not in ("true", "false"):
                raise ValueError(f"trace header {key}={raw[:20]!r} is not true/false")
            kwargs[name] = raw == "true"
        elif kind is float:
            kwargs[name] = float(raw)
        else:
            kwargs[name] = unquote(raw)
    if "mode" not in kwargs or "action" not in kwargs:
        raise ValueError("trace header needs mode= and action=")
    kwargs.setdefault("timestamp", 0.0)
    return TraceEvent(**kwargs)


class TraceRecorder:
    """A bounded, thread-safe ring buffer of :class:`TraceEvent` with subscribers.

    >>> rec = TraceRecorder(capacity=2); rec.record(TraceEvent(mode="prod", action="x")); rec.last().action
    'x'
    """

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("TraceRecorder capacity must be >= 1")
        self._events: deque[TraceEvent] = deque(maxlen=capacity)
        self._subscribers: list[Callable[[TraceEvent], Any]] = []
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        with self._lock:
            self._events.append(event)
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(event)
            except Exception:  # a broken subscriber must not break the request path
                log.exception("trace subscriber %r failed", fn)

    def last(self) -> TraceEvent | None:
        """The newest event, or None."""
        with self._lock:
            return self._events[-1] if self._events else None

    def all(self) -> list[TraceEvent]:
        """Every buffered event, oldest first."""
        with self._lock:
            return list(self._events)

    def query(self, **match: Any) -> list[TraceEvent]:
        """Events whose fields equal ``match`` (``adapter=`` is short for ``adapter_name=``).

        >>> TraceRecorder().query(adapter="code-python-v2", action="fallback_base_model")
        []
        """
        if "adapter" in match:
            match["adapter_name"] = match.pop("adapter")
        if "tenant" in match:
            match["tenant_id"] = match.pop("tenant")
        unknown = set(match) - set(_KINDS)
        if unknown:
            raise TypeError(f"query() got unknown fields {sorted(unknown)}; use TraceEvent field names")
        return [e for e in self.all() if all(getattr(e, k) == v for k, v in match.items())]

    def subscribe(self, fn: Callable[[TraceEvent], Any]) -> Callable[[], None]:
        """Call ``fn(event)`` for every new event; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.all())

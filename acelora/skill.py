"""The routing core: one pure ``MultiLoRA.route()`` that every front-end calls.

No I/O happens here; loads and probes are side effects that front-ends await (``acelora.loading``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from acelora.errors import ConfigError
from acelora.fleet import Fleet, ModelServer, same_base
from acelora.metrics import Metrics
from acelora.names import adapter_hash, is_valid_adapter_name
from acelora.registry import AdapterRegistry, AdapterSpec, compatibility
from acelora.request import (  # noqa: F401  (re-exported: the request types' historical home)
    _MODES,
    ACELORA_FIELDS,
    OVERRIDE_HEADER,
    TENANT_HEADER,
    Decision,
    Mode,
    RouteRequest,
    parse_override,
)
from acelora.trace import (
    COLD_LOADED_APPLIED,
    FALLBACK,
    PREFETCHED_APPLIED,
    REJECTED,
    WOULD_LOAD,
    TraceEvent,
    TraceRecorder,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("acelora")

_REJECTABLE = frozenset({"invalid_name", "unknown_adapter"})
_perf_ns = time.perf_counter_ns


def _mix(x: int) -> int:
    """splitmix64 finaliser: a stable, well-spread score for rendezvous hashing."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class MultiLoRA:
    """The multi-LoRA skill: registry + fleet + mode, and the one ``route()`` every front-end uses.

    >>> skill = MultiLoRA(registry=AdapterRegistry(), mode="shadow", base_model="m")
    >>> skill.route(RouteRequest(model="m")).action is None
    True
    """

    def __init__(self, registry: AdapterRegistry | None = None, fleet: Fleet | None = None, mode: Mode | str = "prod",
                 *, on_unknown: str = "fallback", base_model: str | None = None, engine: str = "vllm",
                 max_lora_rank: int | None = None, base_model_bytes: int | None = None,
                 traces: TraceRecorder | None = None, metrics_registry: CollectorRegistry | None = None,
                 load_timeout_s: float = 30.0, api_keys: dict[str, str] | None = None,
                 admin_key: str | None = None, max_prefetch_hints: int = 8) -> None:
        if on_unknown not in ("fallback", "reject"):
            raise ConfigError(f"on_unknown: {on_unknown!r} is not 'fallback' or 'reject'")
        compatibility(AdapterSpec(name="probe", path="/"), engine)  # validates the kind
        self.registry = registry if registry is not None else AdapterRegistry()
        self.fleet = fleet if fleet is not None else Fleet()
        self.mode = Mode.parse(mode)
        self.on_unknown = on_unknown
        self.base_model = base_model
        self.engine = engine
        self.max_lora_rank = max_lora_rank
        self.base_model_bytes = base_model_bytes
        self.traces = traces if traces is not None else TraceRecorder()
        self.metrics = Metrics(metrics_registry)
        self.load_timeout_s = load_timeout_s
        self.api_keys = dict(api_keys or {})  # bearer key -> tenant (gateway auth)
        self.admin_key = admin_key
        self.max_prefetch_hints = max_prefetch_hints  # lora_prefetch names honoured per request (0: none)
        self.config: Any = None  # the validated AceloraConfig when built by from_config()
        self.resident: set[str] = set()  # adapters known loaded on the upstream when there is no fleet
        self._base_order: dict[tuple[str | None, str | None], tuple[int, list[ModelServer]]] = {}
        self._bases_cache: tuple[Any, frozenset[str]] = (None, frozenset())
        self._cold_ms: dict[str, float] = {}
        self._bytes_per_ms: float | None = None

    @classmethod
    def from_config(cls, path: str, **overrides: Any) -> MultiLoRA:
        """Build a skill from a TOML file (see ``acelora.config``); env ``ACELORA_MODE`` etc. override it."""
        from acelora.config import skill_from_config

        return skill_from_config(path, **overrides)

    # -- the hot path -------------------------------------------------------------------------
    def route(self, req: RouteRequest) -> Decision:
        """Decide what to do with one request. Pure: no I/O, no waiting, microseconds."""
        t0 = _perf_ns()
        mode = self.mode if req.mode is None else _MODES.get(req.mode) or Mode.parse(req.mode)
        if mode is Mode.OFF:
            return Decision(mode, tenant=req.tenant, request_id=req.request_id, route_ns=_perf_ns() - t0)
        specs = self.registry.specs  # registered names are valid: validate only what misses
        model = req.model
        name = req.lora_name
        base_hint = None
        if name is not None:
            spec = specs.get(name)
        elif model is None:
            return self._base_decision(mode, req, t0)
        else:
            spec = specs.get(model)
            if spec is not None:
                name = model
            else:
                bases = self._bases()
                if model in bases:
                    return self._base_decision(mode, req, t0)
                head, colon, tail = model.partition(":")
                if colon and (not bases or head in bases):
                    name, base_hint = tail, head
                    spec = specs.get(name)
                elif not bases:
                    return self._base_decision(mode, req, t0)
                else:
                    name = model
        reason = None
        denied = False
        if spec is None:
            reason = "unknown_adapter" if is_valid_adapter_name(name) else "invalid_name"
        elif not (spec.tenants is None or (req.tenant is not None and req.tenant in spec.tenants)):
            spec, reason = None, "unknown_adapter"  # must look exactly like an unknown adapter
            denied = True
        server = None
        if spec is not None:
            server, reason = self._pick_server(spec, base_hint)
        if reason is not None:
            return self._fallback(mode, req, name, spec, server, reason, base_hint, denied, t0)
        resident = req.resident
        if resident is None:
            resident = name in (server.resident if server is not None else self.resident)
        kind = server.kind if server is not None else self.engine
        base = (server.base_model if server else None) or base_hint or self.base_model
        if base is None and req.lora_name is not None and req.model and not self._selects_adapter(req.model):
            base = req.model
        if mode is Mode.SHADOW:
            action, up_model = WOULD_LOAD, None
        else:
            action = PREFETCHED_APPLIED if resident else COLD_LOADED_APPLIED
            up_model = f"{base}:{name}" if kind == "sglang" else name
        # positional on the hot path: keyword arguments cost 0.2 µs per Decision (fields in declaration order)
        return Decision(mode, action, name, spec, server, up_model, None, resident, mode is Mode.PROD and not resident,
                        False, req.tenant, req.request_id, None, _perf_ns() - t0, base)

    def _bases(self) -> frozenset[str]:
        version = (self.fleet.version, self.base_model)
        if self._bases_cache[0] != version:
            bases = self.fleet.base_models() | ({self.base_model} if self.base_model else set())
            self._bases_cache = (version, frozenset(bases))
        return self._bases_cache[1]

    def _pick_server(self, spec: AdapterSpec, base_hint: str | None) -> tuple[ModelServer | None, str | None]:
        fleet = self.fleet
        cached = spec.placement
        if cached is None or cached[0] != fleet.version or cached[1] != base_hint or cached[4] is not self:
            cached = spec.placement = (fleet.version, base_hint, *self._placement_for(spec, base_hint), self)
        ordered, reason = cached[2], cached[3]
        if reason is not None or not ordered:
            return None, reason
        first_with_room = None
        name = spec.name
        for s in ordered:  # rendezvous order: first resident wins, else first with room
            if not s.healthy:
                continue
            if name in s.resident:
                return s, None
            if first_with_room is None and len(s.resident) < s.capacity:
                first_with_room = s
        if first_with_room is not None:
            return first_with_room, None
        healthy = [s for s in ordered if s.healthy]
        return (healthy[0], None) if healthy else (None, "no_capacity")

    def _placement_for(self, spec: AdapterSpec, base_hint: str | None) -> tuple[list[ModelServer], str | None]:
        """Servers that can run ``spec``, in rendezvous (highest random weight) order, or why none can."""
        servers = self.fleet.servers
        if not servers:
            if not same_base(self.base_model, spec.base_model):
                return [], "incompatible_base"
            if compatibility(spec, self.engine, self.max_lora_rank):
                return [], "unsupported_by_engine"
            return [], None
        cands = [s for s in servers if same_base(s.base_model, spec.base_model)
                 and (base_hint is None or s.base_model == base_hint)]
        if not cands:
            return [], "incompatible_base"
        cands = [s for s in cands if not compatibility(spec, s.kind, s.max_lora_rank)]
        if not cands:
            return [], "unsupported_by_engine"
        key = int(spec.hash, 16)
        return sorted(cands, key=lambda s: _mix(key ^ s.name_hash), reverse=True), None

    def _base_server(self, model: str | None, tenant: str | None) -> ModelServer | None:
        """A server of ``model`` (any server when None), the same one for a tenant while the fleet is unchanged
        (tenant affinity keeps the upstream's prefix cache warm)."""
        fleet = self.fleet
        key = (model, tenant)
        cached = self._base_order.get(key)
        if cached is None or cached[0] != fleet.version:
            cands = [s for s in fleet.servers if model is None or same_base(s.base_model, model)]
            h = int(adapter_hash(tenant or ""), 16)
            cached = (fleet.version, sorted(cands, key=lambda s: _mix(h ^ s.name_hash), reverse=True))
            if len(self._base_order) > 8192:  # client-chosen models/tenants must not grow it forever
                self._base_order.clear()
            self._base_order[key] = cached
        for s in cached[1]:
            if s.healthy:
                return s
        return None

    def _base_decision(self, mode: Mode, req: RouteRequest, t0: int) -> Decision:
        server = self._base_server(req.model, req.tenant)
        return Decision(mode, server=server, tenant=req.tenant, request_id=req.request_id, route_ns=_perf_ns() - t0)

    def _fallback(self, mode: Mode, req: RouteRequest, name: str | None, spec: AdapterSpec | None,
                  server: ModelServer | None, reason: str, base_hint: str | None, denied: bool, t0: int) -> Decision:
        # The base the client meant (the prefix of base:adapter, or model when the adapter came from lora_name),
        # unless that string itself selects an adapter: a client-chosen adapter name never goes upstream.
        meant = base_hint or (req.model if req.lora_name is not None else None)
        if meant is not None and self._selects_adapter(meant):
            meant = None
        if server is None:
            server = self._base_server(meant, req.tenant)
        base = (server.base_model if server else None) or self.base_model or meant
        if mode is Mode.SHADOW:
            action = WOULD_LOAD
        elif self.on_unknown == "reject" and reason in _REJECTABLE:
            action = REJECTED
        else:
            action = FALLBACK
        # Shadow changes nothing, except that another tenant's adapter must never run: send it to the base.
        enforce = mode is Mode.PROD or denied
        reject = action == REJECTED or (enforce and base is None and req.model is not None
                                        and self._selects_adapter(req.model))
        safe_name = None if reason == "invalid_name" else name
        return Decision(mode, REJECTED if reject else action, safe_name, spec, server, base if enforce else None,
                        reason, False if spec else None, False, reject, req.tenant, req.request_id, None,
                        _perf_ns() - t0, base, denied)

    def _selects_adapter(self, model: str) -> bool:
        """True when ``model`` names a registered adapter, directly or as ``base:adapter``."""
        specs = self.registry.specs
        return model in specs or model.partition(":")[2] in specs

    # -- measurements and traces --------------------------------------------------------------
    def observe_load(self, adapter: str, ms: float, size_bytes: int | None = None) -> None:
        """Record a measured cold load (feeds ``swap_ms_saved`` of later requests)."""
        self._cold_ms[adapter] = ms
        if size_bytes and ms > 0:
            bw = size_bytes / ms
            self._bytes_per_ms = bw if self._bytes_per_ms is None else 0.8 * self._bytes_per_ms + 0.2 * bw

    def expected_cold_ms(self, spec: AdapterSpec) -> float | None:
        """Measured cold-load time of ``spec``, else its size over the measured load bandwidth, else None."""
        ms = self._cold_ms.get(spec.name)
        if ms is None and self._bytes_per_ms and spec.size_bytes:
            ms = spec.size_bytes / self._bytes_per_ms
        return ms

    def record(self, decision: Decision, *, served_by: str | None = None, overhead_ms: float | None = None,
               swap_ms: float | None = None) -> TraceEvent | None:
        """Turn an applied decision into a :class:`TraceEvent`, store it and count it (None when not consulted)."""
        if decision.action is None:
            return None
        if decision.denied:
            log.warning("denied: tenant %r may not use adapter %r (answered as unknown_adapter)",
                        decision.tenant, decision.adapter)
        spec = decision.spec
        if swap_ms is None:
            swap_ms = decision.swap_ms
        saved = vram = None
        applied = decision.applied
        if applied and spec is not None:
            if swap_ms is None:
                swap_ms = 0.0 if decision.action == PREFETCHED_APPLIED else None
            expected = self.expected_cold_ms(spec)
            if expected is not None and swap_ms is not None:
                saved = round(max(0.0, expected - swap_ms), 3)
            server = decision.server
            base_bytes = (server.base_model_bytes if server else None) or self.base_model_bytes
            if base_bytes:
                vram = round((base_bytes - spec.size_bytes) / 2**20, 3)
        event = TraceEvent(
            mode=decision.mode.value, action=decision.action, adapter_name=decision.adapter,
            adapter_hash=spec.hash if spec is not None else None, tenant_id=decision.tenant,
            served_by=served_by or (decision.server.name if decision.server else None),
            is_prefetch_hit=(decision.action == PREFETCHED_APPLIED) if applied else None,
            resident=decision.resident, swap_ms=round(swap_ms, 3) if swap_ms is not None else None,
            swap_ms_saved=saved, vram_mb_saved=vram, fallback_reason=decision.fallback_reason,
            overhead_ms=round(overhead_ms if overhead_ms is not None else decision.route_ns / 1e6, 4),
            request_id=decision.request_id,
        )
        self.traces.record(event)
        self.metrics.observe(event)
        return event


"""acelora: one shared base model, hundreds of tenants' LoRA adapters.

>>> import acelora
>>> skill = acelora.MultiLoRA(registry=acelora.AdapterRegistry(), mode="shadow")
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from acelora.errors import (
    AceloraError,
    AdapterNotFound,
    AdapterRejected,
    ConfigError,
    IncompatibleAdapter,
    InvalidAdapter,
    InvalidRequest,
    UnsafeAdapterName,
    UnsafeAdapterPath,
)
from acelora.fleet import Fleet, ModelServer
from acelora.names import adapter_hash, check_adapter_name, file_digest, is_valid_adapter_name
from acelora.registry import AdapterRegistry, AdapterSpec, compatibility
from acelora.residency import AccessResult, Residency
from acelora.skill import Decision, Mode, MultiLoRA, RouteRequest
from acelora.trace import TraceEvent, TraceRecorder, decode_header, encode_header

__version__ = "0.1.0"

# Front-ends load on first use: importing acelora stays cheap for code that only routes.
_LAZY = {
    "wrap_openai": "acelora.client",
    "MultiLoRAMiddleware": "acelora.middleware",
    "create_gateway": "acelora.gateway",
    "ensure_adapter": "acelora.loading",
    "probe_server": "acelora.loading",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'acelora' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AccessResult", "AceloraError", "AdapterNotFound", "AdapterRegistry", "AdapterRejected", "AdapterSpec", "ConfigError",
    "Decision", "Fleet", "IncompatibleAdapter", "InvalidAdapter", "InvalidRequest", "Mode", "ModelServer",
    "MultiLoRA", "MultiLoRAMiddleware", "Residency", "RouteRequest", "TraceEvent", "TraceRecorder", "UnsafeAdapterName",
    "UnsafeAdapterPath", "adapter_hash", "check_adapter_name", "compatibility", "create_gateway", "decode_header",
    "encode_header", "ensure_adapter", "file_digest", "is_valid_adapter_name", "probe_server", "wrap_openai",
]  # fmt: skip

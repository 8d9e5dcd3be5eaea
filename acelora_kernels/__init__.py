"""acelora_kernels: paged multi-adapter LoRA for PyTorch, and a small embedded engine + server.

>>> from acelora_kernels import AdapterPool, attach, lora_batch
>>> from acelora_kernels import Engine, create_app, demo_assets  # doctest: +SKIP
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from acelora_kernels.errors import (
    AdapterInUse,
    AdapterNotResident,
    AdapterTooLarge,
    NonFiniteWeights,
    NotAttached,
    PoolFull,
)
from acelora_kernels.layers import BASE, LoraAttachment, attach, lora_batch
from acelora_kernels.pool import AdapterPool, LoadResult

_LAZY = {
    "Engine": "acelora_kernels.engine",
    "SamplingParams": "acelora_kernels.textgen",
    "GenerationResult": "acelora_kernels.textgen",
    "create_app": "acelora_kernels.server",
    "serve_main": "acelora_kernels.server",
    "demo_assets": "acelora_kernels.demo_adapters",
    "make_demo_adapters": "acelora_kernels.demo_adapters",
    "ByteTokenizer": "acelora_kernels.tiny",
    "tiny_model": "acelora_kernels.tiny",
}

__all__ = [
    "BASE", "AdapterInUse", "AdapterNotResident", "AdapterPool", "AdapterTooLarge", "LoadResult", "LoraAttachment",
    "NonFiniteWeights", "NotAttached", "PoolFull", "attach", "lora_batch", *_LAZY,
]  # fmt: skip


def __getattr__(name: str) -> Any:
    # the engine/server pull in transformers and starlette: import them only when asked for
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'acelora_kernels' has no attribute {name!r}")

"""Multi-adapter forward for Hugging Face causal LMs: ``attach`` once, ``lora_batch`` per batch.

``attach`` puts a forward hook on every linear layer the pool knows (all ``nn.Linear`` but the
output head: for Llama, Mistral, Qwen2/Qwen3, Gemma and Phi-3 that is q/k/v/o and gate/up/down,
or their fused qkv/gate_up forms). The model's modules and state dict stay untouched; outside a
``lora_batch`` the hooks return at once and the model is the base model. Inside, the first hooked
layer of a forward builds the batch metadata and every later layer reuses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from acelora.errors import IncompatibleAdapter
from acelora_kernels import ops
from acelora_kernels.errors import NotAttached
from acelora_kernels.pool import AdapterPool, ResidentAdapter

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
_ATTR = "_acelora_lora"


@dataclass(slots=True)
class _Batch:
    pool: AdapterPool
    row_slot: list[int]
    entries: list[ResidentAdapter]
    backend: str
    meta: ops.LoraBatchMeta | None = None

    def meta_for(self, x: torch.Tensor) -> ops.LoraBatchMeta:
        n = x.numel() // x.shape[-1]
        if self.meta is not None and self.meta.num_tokens == n:
            return self.meta
        rows = len(self.row_slot)
        if n % rows:
            raise ValueError(
                f"lora_batch got {rows} adapter names but the forward has {n} tokens; "
                "pass one name per batch row"
            )
        self.meta = ops.build_meta(self.pool, self.entries, self.row_slot, n // rows, self.backend)
        return self.meta


@dataclass(slots=True)
class LoraAttachment:
    """The hooks ``attach`` installed; ``detach()`` removes them.

    >>> handle = attach(model, pool)  # doctest: +SKIP
    >>> handle.detach()  # doctest: +SKIP
    """

    model: nn.Module
    pool: AdapterPool
    handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    batch: _Batch | None = None

    def detach(self) -> None:
        """Remove the hooks: the model is a plain base model again."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def _hook(self, index: int, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        batch = self.batch
        if batch is None or not batch.entries:
            return None
        x = args[0]
        meta = batch.meta_for(x)
        out = output.reshape(-1, output.shape[-1])
        ops.add_lora(x.reshape(-1, x.shape[-1]), out, meta, index)
        return out.view(output.shape)


def attach(model: nn.Module, pool: AdapterPool) -> LoraAttachment:
    """Hook ``model``'s linear layers so that :func:`lora_batch` applies ``pool``'s adapters.

    >>> handle = attach(model, AdapterPool.for_model(model, budget_bytes=64 << 20))  # doctest: +SKIP
    >>> with lora_batch(model, ["legal-v1", None]): logits = model(ids).logits  # doctest: +SKIP
    """
    existing = getattr(model, _ATTR, None)
    if existing is not None:
        if existing.pool is pool:
            return existing
        raise ValueError("model is already attached to another pool; call .detach() on that attachment first")
    att = LoraAttachment(model, pool)
    for name, spec in pool.modules.items():
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            att.detach()
            raise IncompatibleAdapter(
                f"the pool was built for another model ({name} is missing here); "
                "build it with AdapterPool.for_model(this_model, ...)"
            ) from None
        att.handles.append(mod.register_forward_hook(partial(att._hook, spec.index)))
    setattr(model, _ATTR, att)
    return att


@contextmanager
def lora_batch(model: nn.Module, adapter_names: Sequence[str | None]) -> Iterator[None]:
    """Run the forwards inside with one adapter per batch row (``None``/``"__base__"``: base model).

    The named adapters must be resident; they cannot be evicted until the block exits. Works for
    prefill (``[B, T]``) and for decode steps with a KV cache (``[B, 1]``). One batch per model at a
    time (the engine's step loop): a nested block replaces the outer batch until it exits.

    >>> with lora_batch(model, ["code-python-v2", None, "legal-v1"]):  # doctest: +SKIP
    ...     logits = model(input_ids, attention_mask=mask).logits
    """
    att = getattr(model, _ATTR, None)
    if att is None:
        raise NotAttached("model has no LoRA hooks; call attach(model, pool) before lora_batch(model, ...)")
    if not adapter_names:
        raise ValueError("adapter_names is empty; pass one name (or None) per batch row")
    rows = [None if n is None or n == BASE else n for n in adapter_names]
    distinct = list(dict.fromkeys(n for n in rows if n is not None))
    entries = att.pool.acquire(distinct)
    slot = {n: i for i, n in enumerate(distinct)}
    previous = att.batch
    att.batch = _Batch(
        att.pool, [-1 if n is None else slot[n] for n in rows], entries, ops.pick_backend(att.pool.device)
    )
    try:
        yield
    finally:
        att.batch = previous
        att.pool.release(entries)

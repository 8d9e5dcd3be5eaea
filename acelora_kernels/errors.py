"""Typed errors of the paged adapter pool and the multi-adapter layers.

Each subclasses an ``acelora.errors`` type so callers that already catch the core errors keep
working; each message says what to do next.
"""

from __future__ import annotations

from acelora.errors import AceloraError, AdapterNotFound, IncompatibleAdapter, InvalidAdapter


class PoolFull(AceloraError, RuntimeError):
    """A load needs more pages than are free, even after evicting every evictable adapter.

    >>> raise PoolFull("needs 12 pages, 3 free; unpin adapters or raise budget_bytes")  # doctest: +SKIP
    """


class AdapterTooLarge(PoolFull, IncompatibleAdapter):
    """An adapter larger than the whole pool: no eviction can make room for it.

    >>> raise AdapterTooLarge("needs 9 MiB, the pool holds 4 MiB; raise budget_bytes")  # doctest: +SKIP
    """


class AdapterInUse(AceloraError, RuntimeError):
    """An adapter that the running batch uses cannot be evicted or replaced.

    >>> raise AdapterInUse("legal-v1 is used by the running batch; evict it after the batch")  # doctest: +SKIP
    """


class AdapterNotResident(AdapterNotFound):
    """A name that is not loaded in the pool (``lora_batch``, ``evict``, ``pin``).

    >>> raise AdapterNotResident("legal-v1 is not loaded; call pool.load(name, path) first")  # doctest: +SKIP
    """


class NonFiniteWeights(InvalidAdapter):
    """An adapter whose weights contain NaN or inf: it would poison every row it touches.

    >>> raise NonFiniteWeights("adapters/x: lora_B of q_proj has NaN; retrain or re-export it")  # doctest: +SKIP
    """


class NotAttached(AceloraError, RuntimeError):
    """``lora_batch`` on a model that :func:`acelora_kernels.layers.attach` has not wrapped.

    >>> raise NotAttached("call attach(model, pool) before lora_batch(model, ...)")  # doctest: +SKIP
    """

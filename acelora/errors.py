"""Typed exceptions. Each message says what went wrong and what to do about it."""

from __future__ import annotations

from typing import Any


class AceloraError(Exception):
    """Base class of every acelora error.

    >>> isinstance(AdapterNotFound("x"), AceloraError)
    True
    """


class UnsafeAdapterName(AceloraError, ValueError):
    """An adapter name that is not a plain identifier (paths, `..`, control characters).

    >>> raise UnsafeAdapterName("../etc")  # doctest: +SKIP
    """


class AdapterNotFound(AceloraError, LookupError):
    """No adapter of that name is registered (or the tenant may not use it: the two look the same).

    >>> raise AdapterNotFound("code-python-v2")  # doctest: +SKIP
    """


class InvalidAdapter(AceloraError, ValueError):
    """An adapter directory that cannot be used: missing/invalid config, corrupt weights, bad shapes.

    >>> raise InvalidAdapter("adapters/x: adapter_config.json is missing")  # doctest: +SKIP
    """


class UnsafeAdapterPath(InvalidAdapter):
    """An adapter path that escapes its registry root (including through a symlink).

    >>> raise UnsafeAdapterPath("adapters/x -> /etc")  # doctest: +SKIP
    """


class IncompatibleAdapter(AceloraError, ValueError):
    """An adapter that a model or engine cannot run (architecture, hidden size, unsupported feature).

    >>> raise IncompatibleAdapter("rank 64 > max_lora_rank 16")  # doctest: +SKIP
    """


class ConfigError(AceloraError, ValueError):
    """An invalid acelora configuration; the message names the offending key.

    >>> raise ConfigError("mode: expected one of off, shadow, prod")  # doctest: +SKIP
    """


class AdapterRejected(AceloraError):
    """Raised when a skill configured with ``on_unknown="reject"`` refuses a request.

    >>> raise AdapterRejected("unknown_adapter", "no-such")  # doctest: +SKIP
    """

    def __init__(self, reason: str, adapter: str | None = None) -> None:
        self.reason = reason
        self.adapter = adapter
        super().__init__(f"The model `{adapter}` does not exist." if adapter else reason)


class InvalidRequest(AceloraError, ValueError):
    """A request acelora cannot interpret (e.g. a malformed ``x-ace-skill-override`` header).

    >>> raise InvalidRequest("x-ace-skill-override: unknown mode 'banana'")  # doctest: +SKIP
    """


def describe_validation_error(exc: Any, top: str = "") -> tuple[str, str]:
    """``(where, message)`` of a pydantic ValidationError's first error: the dotted field path (``top``
    when the error is about the whole object) and pydantic's message.

    >>> from pydantic import BaseModel, ValidationError
    >>> class M(BaseModel): r: int
    >>> try: M(r="x")
    ... except ValidationError as e: describe_validation_error(e)
    ('r', 'Input should be a valid integer, unable to parse string as an integer')
    """
    first = exc.errors()[0]
    return ".".join(str(p) for p in first["loc"]) or top, first["msg"]

"""What a request asks of the multi-LoRA skill and what the skill decided: modes, ``RouteRequest``,
``Decision`` (and how a decision rewrites a body). Plain data; the deciding is in ``acelora.skill``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from acelora.errors import ConfigError, InvalidRequest
from acelora.trace import COLD_LOADED_APPLIED, FALLBACK, PREFETCHED_APPLIED, REJECTED, WOULD_LOAD

if TYPE_CHECKING:
    from acelora.fleet import ModelServer
    from acelora.registry import AdapterSpec

OVERRIDE_HEADER = "x-ace-skill-override"
TENANT_HEADER = "x-ace-tenant-id"
# Fields only acelora understands; they never reach an upstream in prod mode.
ACELORA_FIELDS = frozenset({"lora_name", "adapter_rank", "lora_prefetch", "extra_body"})


class Mode(StrEnum):
    """How a skill treats requests: ``off`` (untouched), ``shadow`` (check and log), ``prod`` (apply).

    >>> Mode("shadow") is Mode.SHADOW
    True
    """

    OFF = "off"
    SHADOW = "shadow"
    PROD = "prod"

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        try:
            return value if isinstance(value, Mode) else cls(str(value).strip().lower())
        except ValueError:
            raise ConfigError(f"mode: {value!r} is not one of off, shadow, prod") from None


_MODES = {m.value: m for m in Mode}


def parse_override(header: str | None) -> Mode | None:
    """The ``multi_lora`` mode of an ``x-ace-skill-override`` header (``multi_lora=shadow``), or None.

    >>> parse_override("multi_lora=prod")
    <Mode.PROD: 'prod'>
    """
    if not header:
        return None
    for part in header.replace(";", ",").split(","):
        key, _, value = part.partition("=")
        if key.strip().lower() == "multi_lora":
            mode = _MODES.get(value.strip().lower())
            if mode is None:
                raise InvalidRequest(f"{OVERRIDE_HEADER}: multi_lora={value.strip()[:20]!r} is not off, shadow or prod")
            return mode
    return None


MAX_PREFETCH_HINTS = 8


def prefetch_hints(body: dict[str, Any]) -> list[str]:
    """Adapter names a body asks acelora to pre-load for later requests: ``lora_prefetch`` (a name or a
    list of names, at the top level or in a raw ``extra_body``), at most eight, strings only.

    >>> prefetch_hints({"lora_prefetch": ["legal-compliance-v1", 7, "med-qa-v1"]})
    ['legal-compliance-v1', 'med-qa-v1']
    """
    hint = body.get("lora_prefetch")
    if hint is None:
        extra = body.get("extra_body")
        hint = extra.get("lora_prefetch") if isinstance(extra, dict) else None
    names = [hint] if isinstance(hint, str) else hint if isinstance(hint, list) else []
    return [n for n in names if isinstance(n, str)][:MAX_PREFETCH_HINTS]


@dataclass(slots=True)
class RouteRequest:
    """What ``route()`` needs to know about one request.

    >>> RouteRequest(model="code-python-v2", tenant="tenant_dev_01").model
    'code-python-v2'
    """

    model: str | None = None
    lora_name: str | None = None
    tenant: str | None = None
    mode: Mode | str | None = None
    request_id: str | None = None
    resident: bool | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any], headers: Any = None, tenant: str | None = None,
                  request_id: str | None = None) -> RouteRequest:
        """Build from an OpenAI-style JSON body and headers (a mapping with lower-case keys).

        Adapter order: body ``lora_name``, then ``extra_body.lora_name``, then ``model`` (route() decides
        whether it names an adapter or ``base:adapter``). Raises InvalidRequest on a bad override header.
        """
        extra = body.get("extra_body")
        extra = extra if isinstance(extra, dict) else {}
        lora = body.get("lora_name")
        if lora is None:
            lora = extra.get("lora_name")
        model = body.get("model")
        override = headers.get(OVERRIDE_HEADER) if headers is not None else None
        if tenant is None and headers is not None:
            tenant = headers.get(TENANT_HEADER)
        return cls(
            model=model if isinstance(model, str) else None,
            lora_name=lora if isinstance(lora, str) else (None if lora is None else repr(lora)),
            tenant=tenant,
            mode=parse_override(override),
            request_id=request_id,
        )


@dataclass(slots=True)
class Decision:
    """What to do with one request; front-ends apply it with :meth:`apply` and record it with ``skill.record``.

    >>> Decision(mode=Mode.OFF).apply({"model": "m"})
    {'model': 'm'}
    """

    mode: Mode
    action: str | None = None
    adapter: str | None = None
    spec: AdapterSpec | None = None
    server: ModelServer | None = None
    model: str | None = None
    fallback_reason: str | None = None
    resident: bool | None = None
    needs_load: bool = False
    reject: bool = False
    tenant: str | None = None
    request_id: str | None = None
    swap_ms: float | None = None
    route_ns: int = 0
    base: str | None = None  # the base model to fall back to
    denied: bool = False  # the adapter exists but the tenant may not use it (shown as unknown_adapter)

    @property
    def applied(self) -> bool:
        """True when the request runs on the adapter."""
        return self.action in (PREFETCHED_APPLIED, COLD_LOADED_APPLIED)

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body to send upstream. Off/shadow: ``body`` itself. Prod: a copy with ``model`` rewritten and
        acelora-only fields removed (other ``extra_body`` keys are merged as the OpenAI SDK would)."""
        if self.mode is not Mode.PROD:
            if self.denied and self.model is not None:  # another tenant's adapter never runs, even in shadow
                return {**body, "model": self.model}
            return body
        out = {k: v for k, v in body.items() if k not in ACELORA_FIELDS}
        extra = body.get("extra_body")
        if isinstance(extra, dict):
            for k, v in extra.items():
                if k not in ACELORA_FIELDS:
                    out.setdefault(k, v)
        if self.model is not None:
            out["model"] = self.model
        return out

    def fall_back(self, reason: str) -> Decision:
        """This decision turned into a base-model fallback (e.g. ``load_failed`` after a failed load)."""
        prod = self.mode is Mode.PROD
        reject = prod and self.base is None  # no known base to send it to: refuse rather than guess
        return Decision(
            mode=self.mode, action=(REJECTED if reject else FALLBACK) if prod else WOULD_LOAD,
            adapter=self.adapter, spec=self.spec, server=self.server, model=self.base if prod else None,
            fallback_reason=reason, resident=False, reject=reject, tenant=self.tenant,
            request_id=self.request_id, route_ns=self.route_ns, base=self.base,
        )

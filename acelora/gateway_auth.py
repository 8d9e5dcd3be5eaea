"""Bearer-key auth of the gateway (pure ASGI): tenant keys for OpenAI routes, the admin key for the fleet.

With no keys configured the OpenAI routes are open like vLLM without ``--api-key`` and the tenant comes
from ``x-ace-tenant-id``; the fleet routes stay closed until an admin key is configured. With tenant keys,
the tenant comes only from the key: a client-sent ``x-ace-tenant-id`` is removed before anything downstream
can read it, and only the admin key may turn the skill ``off`` or to ``shadow`` for a request (either would
send the body upstream untouched, another tenant's adapter included). Keys are never echoed.
"""

from __future__ import annotations

import hmac

from acelora.errors import InvalidRequest
from acelora.middleware import TENANT_KEY, Receive, Scope, Send, openai_error, send_json
from acelora.skill import OVERRIDE_HEADER, TENANT_HEADER, Mode, MultiLoRA, parse_override

ADMIN_PREFIX = "/v1/fleet"
ADMIN_KEY = "acelora.admin"
_TENANT = TENANT_HEADER.encode()
_OVERRIDE = OVERRIDE_HEADER.encode()
DOWNGRADE_DENIED = "Overriding multi_lora to 'off' or 'shadow' needs the admin key; tenant keys may only ask for 'prod'."
_AUTH_HEADERS = [(b"www-authenticate", b"Bearer")]


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None.

    >>> bearer_token({"headers": [(b"authorization", b"Bearer sk-1")]})
    'sk-1'
    """
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return None
            return token.strip() or None
    return None


def tenant_for_key(keys: dict[str, str], token: str) -> str | None:
    """The tenant whose key is ``token`` (constant-time comparison against every key), or None.

    >>> tenant_for_key({"sk-1": "tenant_dev_01"}, "sk-1")
    'tenant_dev_01'
    """
    found = None
    raw = token.encode()
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), raw):
            found = tenant
    return found


def is_downgrade(mode: Mode | None) -> bool:
    """True for an override that would let a request bypass routing (``off``/``shadow`` pass bodies untouched).

    >>> is_downgrade(Mode.SHADOW), is_downgrade(Mode.PROD), is_downgrade(None)
    (True, False, False)
    """
    return mode is Mode.OFF or mode is Mode.SHADOW


def may_downgrade(skill: MultiLoRA, scope: Scope) -> bool:
    """Whether this caller may override the mode to ``off``/``shadow``: anyone on a gateway without tenant
    keys (the tenant is self-declared there anyway), only the admin once tenant keys are configured.

    >>> may_downgrade(MultiLoRA(api_keys={"sk-1": "t"}), {"acelora.admin": False})
    False
    """
    return not skill.api_keys or bool(scope.get(ADMIN_KEY))


def downgrade_denied_body() -> bytes:
    """The 403 answered to a tenant key that asks for ``multi_lora=off`` or ``shadow``."""
    return openai_error(403, DOWNGRADE_DENIED, "PermissionDeniedError", OVERRIDE_HEADER)


def _header_downgrades(scope: Scope) -> bool:
    for k, v in scope["headers"]:
        if k == _OVERRIDE:
            try:
                return is_downgrade(parse_override(v.decode("latin-1")))
            except InvalidRequest:  # a malformed header is the router's 400, not ours
                return False
    return False


class GatewayAuth:
    """Checks bearer keys on ``/v1/*``; sets ``scope["acelora.tenant"]`` and ``scope["acelora.admin"]``.

    >>> app = GatewayAuth(app, skill=skill)  # doctest: +SKIP
    >>> # 401 without a valid key, 403 for a tenant key on /v1/fleet/*
    """

    def __init__(self, app, skill: MultiLoRA) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        self.skill = skill

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        keys, admin = self.skill.api_keys, self.skill.admin_key
        if not keys and not admin:
            # OpenAI routes are open, like vLLM without --api-key; the fleet is not: adding a server makes the
            # gateway send requests (and keys) wherever the caller says.
            scope[ADMIN_KEY] = False
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        is_admin = bool(admin and token and hmac.compare_digest(admin.encode(), token.encode()))
        tenant = tenant_for_key(keys, token) if token and keys else None
        if scope["path"].startswith(ADMIN_PREFIX):
            if not is_admin:
                if tenant is not None:
                    await send_json(send, 403, openai_error(
                        403, "This key may not manage the fleet; use the admin key.", "PermissionDeniedError"))
                else:
                    await _unauthorized(send)
                return
        elif keys and not is_admin and tenant is None:
            await _unauthorized(send)
            return
        if keys and not is_admin and _header_downgrades(scope):
            await send_json(send, 403, downgrade_denied_body())
            return
        if keys:
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != _TENANT])
            scope[TENANT_KEY] = tenant
        scope[ADMIN_KEY] = is_admin
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    await send_json(send, 401, openai_error(
        401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.", "AuthenticationError",
        code="invalid_api_key"), _AUTH_HEADERS)

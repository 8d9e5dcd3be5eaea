"""``MultiLoRA.from_config(path)``: a skill from a TOML file, validated at the edge with pydantic.

Example ``acelora.toml``::

    mode = "prod"                 # off | shadow | prod   (env ACELORA_MODE overrides)
    on_unknown = "fallback"       # fallback | reject    (env ACELORA_ON_UNKNOWN)
    base_model = "meta-llama/Llama-3.3-70B-Instruct"

    [registry]
    roots = ["adapters"]          # relative to this file
    public_by_default = true      # adapters granted to no tenant are usable by everyone

    [tenants.tenant_dev_01]
    adapters = ["code-python-v2"]
    api_key_env = "ACELORA_KEY_DEV01"   # the bearer key is read from this env var, never from the file

    [[servers]]
    name = "vllm-primary"
    endpoint = "http://gpu1:8000"
    kind = "vllm"
    base_model = "meta-llama/Llama-3.3-70B-Instruct"
    max_lora_rank = 16

    [prefetch]
    enabled = true                # lora_prefetch hints of prod requests load adapters in the background
    max_hints = 8

    [gateway]
    admin_key_env = "ACELORA_ADMIN_KEY"
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from acelora.errors import ConfigError, describe_validation_error
from acelora.fleet import Fleet, ModelServer
from acelora.registry import AdapterRegistry

if TYPE_CHECKING:
    from acelora.skill import MultiLoRA

ENV_OVERRIDES = {
    "ACELORA_MODE": "mode",
    "ACELORA_ON_UNKNOWN": "on_unknown",
    "ACELORA_BASE_MODEL": "base_model",
    "ACELORA_ENGINE": "engine",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegistryConfig(_Strict):
    roots: list[str] = Field(default_factory=list)
    public_by_default: bool = True
    allow_pickle: bool = False
    index: str | None = None
    digest: bool = True


class TenantConfig(_Strict):
    adapters: list[str] = Field(default_factory=list)
    api_key_env: str | None = None


class ServerConfig(_Strict):
    name: str
    endpoint: str
    kind: Literal["vllm", "sglang", "openai"] = "vllm"
    base_model: str | None = None
    api_key_env: str | None = None
    capacity: int = Field(8, ge=1)
    max_lora_rank: int | None = Field(None, ge=1)
    base_model_bytes: int | None = Field(None, ge=0)


class PrefetchConfig(_Strict):
    enabled: bool = True  # honour the lora_prefetch hints of prod requests
    max_hints: int = Field(8, ge=0, le=64)  # adapters one request may ask to pre-load


class GatewayConfig(_Strict):
    admin_key_env: str | None = None
    upstream: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    timeout_s: float = Field(120.0, gt=0)  # each upstream read
    max_stream_s: float = Field(900.0, gt=0)  # a whole streamed answer


class AceloraConfig(_Strict):
    mode: Literal["off", "shadow", "prod"] = "prod"
    on_unknown: Literal["fallback", "reject"] = "fallback"
    base_model: str | None = None
    base_model_bytes: int | None = Field(None, ge=0)
    engine: Literal["vllm", "sglang", "openai"] = "vllm"
    max_lora_rank: int | None = Field(None, ge=1)
    load_timeout_s: float = Field(30.0, gt=0)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    servers: list[ServerConfig] = Field(default_factory=list)
    prefetch: PrefetchConfig = Field(default_factory=PrefetchConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)


def load_config(path: str | Path, env: dict[str, str] | None = None) -> AceloraConfig:
    """Parse and validate a TOML config (environment overrides applied); one ConfigError names the key.

    >>> load_config("acelora.toml").mode  # doctest: +SKIP
    'prod'
    """
    env = dict(os.environ) if env is None else env
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for var, key in ENV_OVERRIDES.items():
        if env.get(var):
            raw[key] = env[var]
    try:
        return AceloraConfig.model_validate(raw)
    except ValidationError as e:
        where, msg = describe_validation_error(e, "(top level)")
        raise ConfigError(f"{path}: {where}: {msg}") from None


def _key_from_env(var: str, where: str, env: dict[str, str]) -> str:
    value = env.get(var)
    if not value:
        raise ConfigError(f"{where}: environment variable {var} is not set (it must hold the key)")
    return value


def skill_from_config(path: str | Path, env: dict[str, str] | None = None, **overrides: Any) -> MultiLoRA:
    """Build a :class:`MultiLoRA` from a TOML file; keyword ``overrides`` win over the file."""
    from acelora.skill import MultiLoRA

    env = dict(os.environ) if env is None else env
    cfg = load_config(path, env)
    here = Path(path).resolve().parent
    grants = {t: tc.adapters for t, tc in cfg.tenants.items()}
    registry = AdapterRegistry(grants=grants, public_by_default=cfg.registry.public_by_default)
    for i, root in enumerate(cfg.registry.roots):
        root_path = (here / root) if not Path(root).is_absolute() else Path(root)
        if not root_path.is_dir():
            raise ConfigError(f"{path}: registry.roots[{i}]: {root_path} is not a directory")
        index = (here / cfg.registry.index) if cfg.registry.index and len(cfg.registry.roots) == 1 else None
        registry.scan(root_path, allow_pickle=cfg.registry.allow_pickle, index=index, digest=cfg.registry.digest)
    api_keys: dict[str, str] = {}
    for tenant, tc in cfg.tenants.items():
        if tc.api_key_env:
            api_keys[_key_from_env(tc.api_key_env, f"{path}: tenants.{tenant}.api_key_env", env)] = tenant
    admin_key = None
    if cfg.gateway.admin_key_env:
        admin_key = _key_from_env(cfg.gateway.admin_key_env, f"{path}: gateway.admin_key_env", env)
    try:
        fleet = Fleet(ModelServer(**s.model_dump()) for s in cfg.servers)
    except ConfigError as e:
        raise ConfigError(f"{path}: servers: {e}") from None
    kwargs: dict[str, Any] = dict(
        registry=registry, fleet=fleet, mode=cfg.mode, on_unknown=cfg.on_unknown, base_model=cfg.base_model,
        engine=cfg.engine, max_lora_rank=cfg.max_lora_rank, base_model_bytes=cfg.base_model_bytes,
        load_timeout_s=cfg.load_timeout_s, api_keys=api_keys, admin_key=admin_key,
        max_prefetch_hints=cfg.prefetch.max_hints if cfg.prefetch.enabled else 0,
    )
    kwargs.update(overrides)
    skill = MultiLoRA(**kwargs)
    skill.config = cfg
    return skill

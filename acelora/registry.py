"""The adapter registry: validated PEFT adapter directories and who may use them."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from acelora.errors import InvalidAdapter, UnsafeAdapterName, UnsafeAdapterPath
from acelora.names import adapter_hash, check_adapter_name, file_digest, is_valid_adapter_name
from acelora.peft_format import (
    CONFIG_NAME,
    PICKLE_NAME,
    SAFETENSORS_NAME,
    lora_modules,
    read_config,
    read_safetensors_header,
)

log = logging.getLogger("acelora.registry")

ENGINE_KINDS = ("vllm", "sglang", "openai")
LARGE_RANK_WARNING = 64
INDEX_VERSION = 1
# vLLM accepts modules_to_save only for these heads (REFERENCE.md).
_VLLM_SAVE_OK = {"classifier", "score"}


@dataclass(slots=True)
class AdapterSpec:
    """A validated LoRA adapter. ``tenants=None`` means public; otherwise only those tenants may use it.

    >>> AdapterSpec(name="x", path="/a/x", rank=8).rank
    8
    """

    name: str
    path: str
    base_model: str | None = None
    rank: int = 8
    lora_alpha: float = 8.0
    use_rslora: bool = False
    target_modules: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_dora: bool = False
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    size_bytes: int = 0
    dtype: str = "F32"
    digest: str | None = None
    tenants: frozenset[str] | None = None
    hash: str = ""
    # route()'s cached placement (fleet version, base hint, servers, reason); not part of the description
    placement: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.hash:
            self.hash = adapter_hash(self.name)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("placement")
        d["tenants"] = sorted(self.tenants) if self.tenants is not None else None
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AdapterSpec:
        d = dict(d)
        if d.get("tenants") is not None:
            d["tenants"] = frozenset(d["tenants"])
        return cls(**d)


def compatibility(spec: AdapterSpec, kind: str, max_rank: int | None = None) -> list[str]:
    """Reasons an engine of ``kind`` cannot run ``spec`` (empty list: it can). See REFERENCE.md.

    >>> compatibility(AdapterSpec(name="x", path="/x", rank=64), "vllm", max_rank=16)
    ['rank 64 > max_lora_rank 16']
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")
    reasons = []
    if kind in ("vllm", "sglang"):
        if spec.use_dora:
            reasons.append("use_dora")
        if spec.bias != "none":
            reasons.append(f"bias={spec.bias}")
        if spec.lora_bias:
            reasons.append("lora_bias")
        extra = [m for m in spec.modules_to_save if m not in _VLLM_SAVE_OK]
        if extra:
            reasons.append(f"modules_to_save={','.join(extra)}")
        if max_rank is not None and spec.rank > max_rank:
            reasons.append(f"rank {spec.rank} > max_lora_rank {max_rank}")
    if kind == "sglang":
        # SGLang always scales alpha/r and ignores patterns: such adapters would give wrong output.
        if spec.use_rslora:
            reasons.append("use_rslora")
        if spec.rank_pattern:
            reasons.append("rank_pattern")
        if spec.alpha_pattern:
            reasons.append("alpha_pattern")
    return reasons


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def load_spec(adapter_dir: str | Path, name: str, *, root: str | Path | None = None,
              allow_pickle: bool = False, digest: bool = True) -> AdapterSpec:
    """Validate one PEFT adapter directory (header-only read) and describe it.

    >>> load_spec("adapters/code-python-v2", "code-python-v2")  # doctest: +SKIP
    """
    check_adapter_name(name)
    real = Path(adapter_dir).resolve()
    if root is not None:
        root_real = Path(root).resolve()
        if not _inside(real, root_real):
            raise UnsafeAdapterPath(f"{adapter_dir} resolves outside the registry root {root}")
    if not real.is_dir():
        raise InvalidAdapter(f"{adapter_dir} is not a directory")
    st = real / SAFETENSORS_NAME
    files = [real / CONFIG_NAME]
    for f in (real / CONFIG_NAME, st, real / PICKLE_NAME):
        # checked before anything is read: a config symlinked to /dev/zero must not be opened
        if f.is_symlink() and root is not None and not _inside(f.resolve(), Path(root).resolve()):
            raise UnsafeAdapterPath(f"{f} is a symlink out of the registry root {root}")
    config = read_config(real)
    if st.exists():
        tensors, _ = read_safetensors_header(st)
        modules = lora_modules(tensors, config, where=str(adapter_dir))
        lora = [t for n, t in tensors.items() if ".lora_" in n]
        dtype = lora[0].dtype if lora else "F32"
        size = sum(t.end - t.start for t in tensors.values())
        files.append(st)
    elif (real / PICKLE_NAME).exists():
        if not allow_pickle:
            raise InvalidAdapter(
                f"{adapter_dir}: only {PICKLE_NAME} (a pickle, which can run code) was found; convert it to "
                f"{SAFETENSORS_NAME} or pass allow_pickle=True if you trust its origin"
            )
        modules, dtype, size = [], "unknown", (real / PICKLE_NAME).stat().st_size
        files.append(real / PICKLE_NAME)
    else:
        raise InvalidAdapter(f"{adapter_dir}: no {SAFETENSORS_NAME} next to {CONFIG_NAME}")
    rank = max([config.max_rank, *(m.rank for m in modules)])
    if rank > LARGE_RANK_WARNING:
        log.warning("adapter %s has rank %d (> %d): most engines must be started with a larger max rank",
                    name, rank, LARGE_RANK_WARNING)
    targets = config.target_modules
    target_list = [targets] if isinstance(targets, str) else list(targets or [])
    return AdapterSpec(
        name=name, path=str(real), base_model=config.base_model_name_or_path, rank=rank,
        lora_alpha=float(config.lora_alpha), use_rslora=config.use_rslora, target_modules=sorted(target_list),
        rank_pattern=dict(config.rank_pattern), alpha_pattern=dict(config.alpha_pattern),
        use_dora=config.use_dora, bias=config.bias, lora_bias=config.lora_bias,
        modules_to_save=list(config.modules_to_save or []), size_bytes=size, dtype=dtype,
        digest=file_digest(*files) if digest else None,
    )


def _fingerprint(adapter_dir: Path) -> list[list[Any]]:
    out = []
    for fname in (CONFIG_NAME, SAFETENSORS_NAME, PICKLE_NAME):
        p = adapter_dir / fname
        try:
            s = p.stat()
        except FileNotFoundError:
            continue
        out.append([fname, s.st_mtime_ns, s.st_size])
    return out


def _adapter_dirs(root: Path) -> Iterator[tuple[str, Path]]:
    """(name, dir) for each adapter under ``root``: ``root/<name>/`` or PEFT's nested ``root/<d>/<name>/``."""
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if (child / CONFIG_NAME).exists():
            yield child.name, child
            continue
        for nested in sorted(child.iterdir()):
            if nested.is_dir() and (nested / CONFIG_NAME).exists():
                yield nested.name, nested


class AdapterRegistry:
    """Validated adapters by name, with per-tenant access.

    >>> reg = AdapterRegistry(); len(reg), reg.get("code-python-v2")
    (0, None)
    """

    def __init__(self, specs: Iterable[AdapterSpec] = (), *, grants: Mapping[str, Iterable[str]] | None = None,
                 public_by_default: bool = True) -> None:
        self._specs: dict[str, AdapterSpec] = {}
        self.specs: Mapping[str, AdapterSpec] = self._specs  # the live name -> spec map: read it, use add/remove
        self._grants: dict[str, set[str]] = {t: set(names) for t, names in (grants or {}).items()}
        self.public_by_default = public_by_default
        self.errors: dict[str, str] = {}  # skipped directories -> why, from the last scan
        self._lock = threading.Lock()
        for spec in specs:
            self.add(spec)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, root: str | Path, tenants: Mapping[str, Iterable[str]] | None = None, *,
                 public_by_default: bool = True, allow_pickle: bool = False, index: str | Path | None = None,
                 digest: bool = True) -> AdapterRegistry:
        """Scan PEFT adapter directories under ``root``; invalid ones are skipped and listed in ``.errors``.

        >>> reg = AdapterRegistry.from_dir("adapters/", tenants={"tenant_dev_01": ["code-python-v2"]})  # doctest: +SKIP
        """
        reg = cls(grants=tenants, public_by_default=public_by_default)
        reg.scan(root, allow_pickle=allow_pickle, index=index, digest=digest)
        return reg

    def scan(self, root: str | Path, *, allow_pickle: bool = False, index: str | Path | None = None,
             digest: bool = True) -> int:
        """Add every valid adapter under ``root`` (reusing fresh entries of the JSON ``index``); returns the count."""
        root_p = Path(root)
        if not root_p.is_dir():
            raise InvalidAdapter(f"registry root {root} is not a directory")
        root_real = root_p.resolve()
        cached = self._read_index(index, root_real) if index else {}
        fresh_index: dict[str, Any] = {}
        count = 0
        for name, d in _adapter_dirs(root_p):
            fp = _fingerprint(d)
            hit = cached.get(name)
            try:
                if not is_valid_adapter_name(name):
                    raise UnsafeAdapterName(f"directory name {name!r} is not a valid adapter name")
                spec = None
                if hit is not None and hit.get("fingerprint") == fp and hit.get("dir") == str(d):
                    try:
                        spec = AdapterSpec.from_json(hit["spec"])
                    except (TypeError, KeyError, ValueError):
                        spec = None  # a damaged entry is just stale
                    # the index is a cache, not an authority: it may only describe this very directory
                    if spec is not None and (spec.name != name or spec.path != str(d.resolve())):
                        spec = None
                if spec is not None:
                    spec.tenants = None  # grants come from this registry, not from the index
                    if not _inside(Path(spec.path).resolve(), root_real):
                        raise UnsafeAdapterPath(f"{d} resolves outside the registry root {root}")
                else:
                    spec = load_spec(d, name, root=root_real, allow_pickle=allow_pickle, digest=digest)
            except (InvalidAdapter, UnsafeAdapterName) as e:
                self.errors[str(d)] = str(e)
                log.warning("skipping adapter directory %s: %s", d, e)
                continue
            if name in self._specs and self._specs[name].path != spec.path:
                self.errors[str(d)] = f"duplicate adapter name {name!r} (already at {self._specs[name].path})"
                log.warning("skipping %s: duplicate adapter name %s", d, name)
                continue
            self.add(spec)
            fresh_index[name] = {"dir": str(d), "fingerprint": fp, "spec": spec.to_json()}
            count += 1
        if index:
            self._write_index(index, root_real, fresh_index)
        return count

    @staticmethod
    def _read_index(index: str | Path, root: Path) -> dict[str, Any]:
        try:
            data = json.loads(Path(index).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != INDEX_VERSION or data.get("root") != str(root):
            return {}
        entries = data.get("adapters")
        return entries if isinstance(entries, dict) else {}

    @staticmethod
    def _write_index(index: str | Path, root: Path, entries: dict[str, Any]) -> None:
        tmp = Path(f"{index}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"version": INDEX_VERSION, "root": str(root), "adapters": entries}))
        os.replace(tmp, index)

    # -- mutation -----------------------------------------------------------------------------
    def add(self, spec: AdapterSpec | str | Path, name: str | None = None, *, allow_pickle: bool = False) -> AdapterSpec:
        """Register a spec, or validate and register an adapter directory (its name defaults to the dir name)."""
        if not isinstance(spec, AdapterSpec):
            spec = load_spec(spec, name or Path(spec).name, allow_pickle=allow_pickle)
        check_adapter_name(spec.name)
        with self._lock:
            granted = {t for t, names in self._grants.items() if spec.name in names}
            if spec.tenants is None and granted:
                spec.tenants = frozenset(granted)
            elif spec.tenants is None and not self.public_by_default:
                spec.tenants = frozenset()
            self._specs[spec.name] = spec
        return spec

    def remove(self, name: str) -> AdapterSpec | None:
        """Forget an adapter; returns its spec, or None if it was not registered."""
        with self._lock:
            return self._specs.pop(name, None)

    def grant(self, tenant: str, *names: str) -> None:
        """Let ``tenant`` use ``names`` (each adapter then stops being public)."""
        with self._lock:
            self._grants.setdefault(tenant, set()).update(names)
            for n in names:
                spec = self._specs.get(n)
                if spec is not None:
                    spec.tenants = frozenset((spec.tenants or frozenset()) | {tenant})

    # -- queries ------------------------------------------------------------------------------
    def get(self, name: str) -> AdapterSpec | None:
        return self._specs.get(name)

    def is_allowed(self, tenant: str | None, name: str) -> bool:
        """True if ``tenant`` may use adapter ``name`` (an unknown adapter is never allowed)."""
        spec = self._specs.get(name)
        if spec is None:
            return False
        return spec.tenants is None or (tenant is not None and tenant in spec.tenants)

    def visible_to(self, tenant: str | None) -> list[AdapterSpec]:
        """The adapters ``tenant`` may use, by name."""
        return [s for s in self._specs.values() if s.tenants is None or (tenant is not None and tenant in s.tenants)]

    def compatibility(self, spec: AdapterSpec | str, kind: str, max_rank: int | None = None) -> list[str]:
        """See :func:`compatibility`; accepts a name too."""
        if isinstance(spec, str):
            found = self.get(spec)
            if found is None:
                raise KeyError(spec)
            spec = found
        return compatibility(spec, kind, max_rank)

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[AdapterSpec]:
        return iter(list(self._specs.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._specs

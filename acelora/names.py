"""Adapter names, stable hashes and file digests."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import xxhash

from acelora.errors import UnsafeAdapterName

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_valid_adapter_name(name: object) -> bool:
    """True when ``name`` is a safe adapter identifier (never a path).

    >>> is_valid_adapter_name("code-python-v2"), is_valid_adapter_name("../etc")
    (True, False)
    """
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and ".." not in name


def check_adapter_name(name: object) -> str:
    """Return ``name`` if it is a safe identifier, else raise :class:`UnsafeAdapterName`.

    >>> check_adapter_name("med-qa-v1")
    'med-qa-v1'
    """
    if not is_valid_adapter_name(name):
        shown = repr(name)[:80]
        raise UnsafeAdapterName(
            f"adapter name {shown} is not an identifier: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return name  # type: ignore[return-value]


def adapter_hash(name: str) -> str:
    """xxh3-64 of the name as 16 hex digits; the same in every process.

    >>> adapter_hash("code-python-v2") == adapter_hash("code-python-v2")
    True
    """
    return xxhash.xxh3_64_hexdigest(name.encode("utf-8"))


def file_digest(*paths: str | Path, chunk: int = 1 << 20) -> str:
    """Streaming sha256 over the given files, in order (``sha256:<hex>``).

    >>> file_digest()  # doctest: +ELLIPSIS
    'sha256:e3b0...'
    """
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return "sha256:" + h.hexdigest()

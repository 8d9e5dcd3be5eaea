"""The ``acelora`` command line (also ``python -m acelora``): demo, serve, gateway, probe, registry, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence


def _registry(args: argparse.Namespace) -> int:
    from acelora.errors import AceloraError
    from acelora.registry import AdapterRegistry, compatibility

    try:
        reg = AdapterRegistry.from_dir(args.root, allow_pickle=args.allow_pickle, digest=not args.no_digest)
    except (AceloraError, OSError) as e:
        if args.json:
            print(json.dumps({"error": str(e)}))
        print(f"acelora registry: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for spec in sorted(reg, key=lambda s: s.name):
        row = {"name": spec.name, "rank": spec.rank, "size_bytes": spec.size_bytes, "dtype": spec.dtype,
               "base_model": spec.base_model, "targets": spec.target_modules}
        if args.kind:
            row["unsupported"] = compatibility(spec, args.kind, args.max_rank)
        rows.append(row)
    if args.json:
        print(json.dumps({"adapters": rows, "errors": reg.errors}, indent=2))
    else:
        for r in rows:
            extra = f"  UNSUPPORTED: {', '.join(r['unsupported'])}" if r.get("unsupported") else ""
            print(f"{r['name']:40s} r={r['rank']:<4d} {r['size_bytes'] / 2**20:8.2f} MiB {r['dtype']}{extra}")
        for where, why in reg.errors.items():
            print(f"skipped {where}: {why}", file=sys.stderr)
    return 0 if not reg.errors else 1


def _probe(args: argparse.Namespace) -> int:
    import httpx

    from acelora.fleet import ModelServer
    from acelora.loading import probe_server

    server = ModelServer(name=args.name, endpoint=args.endpoint, kind=args.kind, api_key_env=args.api_key_env)

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            await probe_server(server, client, timeout_s=args.timeout)

    try:
        asyncio.run(run())
    except Exception as e:  # report any failure to reach or parse the server, then exit non-zero
        print(f"probe failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(server.public_dict(), indent=2))
    return 0


def _delegate(module: str, func: str, argv: Sequence[str]) -> int:
    from importlib import import_module

    try:
        mod = import_module(module)
    except ImportError as e:
        print(f"this command needs an optional part of acelora that is not installed ({e}); "
              "install it with: pip install 'acelora[all]'", file=sys.stderr)
        return 2
    return int(getattr(mod, func)(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``acelora`` console script.

    >>> main(["registry", "adapters/"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = {
        "demo": ("acelora.demo", "demo_main"),
        "serve": ("acelora_kernels.server", "serve_main"),
        "gateway": ("acelora.gateway", "gateway_main"),
        "bench": ("acelora.bench", "bench_main"),
    }
    if argv and argv[0] in delegated:
        return _delegate(*delegated[argv[0]], argv[1:])
    parser = argparse.ArgumentParser(prog="acelora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the end-to-end demo on the embedded engine (CPU)")
    sub.add_parser("serve", help="serve the embedded engine with vLLM's API")
    sub.add_parser("gateway", help="run the OpenAI-compatible gateway from a config file")
    sub.add_parser("bench", help="run a benchmark (route)")
    p = sub.add_parser("registry", help="scan and validate a directory of PEFT adapters")
    p.add_argument("root")
    p.add_argument("--kind", choices=["vllm", "sglang", "openai"], help="also check what this engine can run")
    p.add_argument("--max-rank", type=int, default=None)
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--no-digest", action="store_true", help="skip the sha256 of each adapter's files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_registry)
    p = sub.add_parser("probe", help="ask a server what it serves and supports")
    p.add_argument("endpoint")
    p.add_argument("--kind", choices=["vllm", "sglang", "openai"], default="vllm")
    p.add_argument("--name", default="probed")
    p.add_argument("--api-key-env", default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    p.set_defaults(func=_probe)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

"""``acelora serve``: build an engine (tiny model + demo adapters unless told otherwise) and serve it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from acelora.names import is_valid_adapter_name
from acelora.peft_format import CONFIG_NAME, SAFETENSORS_NAME

DEFAULT_PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` options (vLLM's names where vLLM has one).

    >>> build_parser().parse_args([]).port
    8000
    """
    p = argparse.ArgumentParser(prog="acelora serve", description=__doc__)
    p.add_argument("--model", help="local HF causal LM directory (default: the built-in tiny Llama)")
    p.add_argument("--served-model-name", help="name clients use for the base model")
    p.add_argument("--adapters", help="directory of PEFT adapter directories served from the start "
                   "(default with no --model: the demo adapters, made on first use)")  # fmt: skip
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="extra static adapters")
    p.add_argument(
        "--demo-adapters", type=int, default=5, metavar="N", help="how many demo adapters (default 5)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-loras", type=int, default=32, help="distinct adapters in one batch")
    p.add_argument(
        "--max-cpu-loras", type=int, help="size the adapter pool to hold this many of the largest adapter"
    )
    p.add_argument(
        "--pool-mb", type=float, default=64.0, help="adapter pool size when --max-cpu-loras is not given"
    )
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64, help="sequences decoded together")
    p.add_argument(
        "--max-tokens-cap", type=int, default=1024, help="largest max_tokens a request may ask for"
    )
    p.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        help="route /v1/load_lora_adapter and /v1/unload_lora_adapter (also: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    p.add_argument(
        "--allowed-adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="directory runtime loads may read from (the --adapters directory always is)",
    )
    p.add_argument("--log-level", default="info")
    return p  # fmt: skip


def static_adapters(adapters_dir: str | os.PathLike[str] | None, modules: list[str]) -> dict[str, Path]:
    """Every ``<dir>/<name>/adapter_config.json`` with a valid name, plus ``NAME=PATH`` entries.

    >>> static_adapters(None, [])
    {}
    """
    found: dict[str, Path] = {}
    if adapters_dir is not None:
        root = Path(adapters_dir).resolve()
        for sub in sorted(root.iterdir()):
            if sub.is_dir() and (sub / CONFIG_NAME).is_file() and is_valid_adapter_name(sub.name):
                found[sub.name] = sub
    for item in modules:
        name, sep, path = item.partition("=")
        if not sep or not is_valid_adapter_name(name) or not Path(path).is_absolute():
            raise SystemExit(f"--lora-modules {item!r}: expected NAME=/absolute/path/to/adapter")
        found[name] = Path(path).resolve()
    return found


def build_app(args: argparse.Namespace) -> tuple[Any, str]:
    """The app for parsed ``serve`` arguments and a one-line description of what it serves."""
    from acelora_kernels.demo_adapters import demo_assets
    from acelora_kernels.engine import Engine
    from acelora_kernels.pool import AdapterPool
    from acelora_kernels.server import create_app
    from acelora_kernels.tiny import TINY_MODEL_NAME, load_model_and_tokenizer, weight_bytes

    adapters_dir = args.adapters
    if args.model is None:
        assets = demo_assets(args.demo_adapters)
        model_dir, name = assets.base_dir, args.served_model_name or TINY_MODEL_NAME
        adapters_dir = adapters_dir or assets.adapters_dir
    else:
        model_dir, name = Path(args.model), args.served_model_name or args.model
    model, tokenizer = load_model_and_tokenizer(model_dir)
    adapters = static_adapters(adapters_dir, args.lora_modules)
    if args.max_cpu_loras:
        largest = max(
            (p.joinpath(SAFETENSORS_NAME).stat().st_size for p in adapters.values()), default=1 << 20
        )
        budget = args.max_cpu_loras * (largest + (1 << 16))
    else:
        budget = int(args.pool_mb * (1 << 20))
    pool = AdapterPool.for_model(model, budget)
    engine = Engine(model, tokenizer, pool, adapters, max_batch=args.max_batch, max_loras=args.max_loras)
    roots = [*([adapters_dir] if adapters_dir else []), *args.allowed_adapter_root]
    app = create_app(
        engine, name, model_root=str(model_dir), allow_runtime_lora=args.enable_runtime_lora or None,
        adapter_roots=roots, max_lora_rank=args.max_lora_rank, max_tokens_cap=args.max_tokens_cap,
        base_weight_bytes=weight_bytes(model),
    )  # fmt: skip
    return app, f"{name} + {len(adapters)} adapters"


def main(argv: list[str] | None = None) -> int:
    """Parse, build and run uvicorn until interrupted; returns the exit status."""
    import uvicorn

    args = build_parser().parse_args(argv)
    app, what = build_app(args)
    print(f"acelora engine: serving {what} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    app.state.server.engine.close()
    return 0

"""``acelora serve``: build an engine (tiny model + demo adapters unless told otherwise) and serve it.

An argument that cannot work (a missing directory, a malformed ``--lora-modules`` entry, a model
that does not load) ends the command with one line on stderr and exit status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from acelora.names import is_valid_adapter_name
from acelora.peft_format import CONFIG_NAME, SAFETENSORS_NAME

DEFAULT_PORT = 8000


class ServeArgumentError(ValueError):
    """A ``serve`` argument that cannot work; the message names the option and what to fix.

    >>> raise ServeArgumentError("--adapters /nope: not a directory")  # doctest: +SKIP
    """


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _warn(message: str) -> None:
    print(f"acelora serve: warning: {message}", file=sys.stderr, flush=True)


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
        "--demo-adapters",
        type=_at_least(1),
        default=5,
        metavar="N",
        help="how many demo adapters (default 5)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_at_least(0), default=DEFAULT_PORT)
    p.add_argument("--max-loras", type=_at_least(1), default=32, help="distinct adapters in one batch")
    p.add_argument(
        "--max-cpu-loras",
        type=_at_least(1),
        help="size the adapter pool to hold this many of the largest adapter",
    )
    p.add_argument(
        "--pool-mb",
        type=_positive_float,
        default=64.0,
        help="adapter pool size when --max-cpu-loras is not given",
    )
    p.add_argument("--max-lora-rank", type=_at_least(1), default=64)
    p.add_argument("--max-batch", type=_at_least(1), default=64, help="sequences decoded together")
    p.add_argument(
        "--max-tokens-cap", type=_at_least(1), default=1024, help="largest max_tokens a request may ask for"
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

    An adapter of ``adapters_dir`` that would read a file from outside it (a symlinked directory,
    config or weights file) is skipped with a warning; a bad argument raises :class:`ServeArgumentError`.

    >>> static_adapters(None, [])
    {}
    """
    from acelora_kernels.server_lora import outside_roots

    found: dict[str, Path] = {}
    if adapters_dir is not None:
        if not Path(adapters_dir).is_dir():
            raise ServeArgumentError(
                f"--adapters {adapters_dir}: not a directory of PEFT adapter directories"
            )
        root = Path(adapters_dir).resolve()
        try:
            subs = sorted(root.iterdir())
        except OSError as e:
            raise ServeArgumentError(f"--adapters {adapters_dir}: cannot list it ({e.strerror})") from None
        for sub in subs:
            if not (sub.is_dir() and (sub / CONFIG_NAME).is_file() and is_valid_adapter_name(sub.name)):
                continue
            escape = outside_roots(sub, [root])
            if escape is not None:
                _warn(f"skipping adapter {sub.name!r}: {escape} (the --adapters directory)")
                continue
            found[sub.name] = sub
    for item in modules:
        name, sep, path = item.partition("=")
        if not sep or not is_valid_adapter_name(name) or not Path(path).is_absolute():
            raise ServeArgumentError(f"--lora-modules {item!r}: expected NAME=/absolute/path/to/adapter")
        if not (Path(path) / CONFIG_NAME).is_file():
            raise ServeArgumentError(f"--lora-modules {item!r}: {path} has no {CONFIG_NAME}")
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
        if not model_dir.is_dir():
            raise ServeArgumentError(f"--model {args.model}: not a local model directory")
    for extra in args.allowed_adapter_root:
        if not Path(extra).is_dir():
            raise ServeArgumentError(f"--allowed-adapter-root {extra}: not a directory")
    adapters = static_adapters(adapters_dir, args.lora_modules)  # before the model: fail fast
    try:
        model, tokenizer = load_model_and_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ServeArgumentError(f"--model {model_dir}: cannot load a causal LM from it ({reason})") from None
    if args.max_cpu_loras:
        largest = max(
            (f.stat().st_size for p in adapters.values() if (f := p / SAFETENSORS_NAME).is_file()),
            default=1 << 20,
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
    try:
        app, what = build_app(args)
    except ServeArgumentError as e:
        print(f"acelora serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"acelora engine: serving {what} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    app.state.server.engine.close()
    return 0

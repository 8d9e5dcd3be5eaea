"""``acelora serve`` / ``python -m acelora_kernels.server``: zero-setup default, options, hints."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
from engine_support import CHAT, LiveServer, make_engine

from acelora_kernels.serve_cli import ServeArgumentError, build_app, build_parser, main, static_adapters
from acelora_kernels.server import create_app
from acelora_kernels.tiny import TINY_MODEL_NAME


def test_module_entry_point_prints_help() -> None:
    out = subprocess.run([sys.executable, "-m", "acelora_kernels.server", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "--max-cpu-loras" in out.stdout and "--enable-runtime-lora" in out.stdout


def test_no_arguments_serves_the_tiny_model_with_the_demo_adapters(demo, monkeypatch) -> None:
    monkeypatch.setenv("ACELORA_CACHE", str(demo.root.parent))  # the session's demo set, already made
    args = build_parser().parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    app, what = build_app(args)
    assert what == f"{TINY_MODEL_NAME} + 5 adapters"
    live = LiveServer(app)
    try:
        ids = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
        assert ids[0] == TINY_MODEL_NAME and sorted(ids[1:]) == sorted(demo.adapters)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model="code-python-v2", messages=CHAT, temperature=0, max_tokens=40
        )
        assert out.choices[0].message.content.startswith("[code]")
        r = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})  # runtime loading is opt-in
        info = httpx.get(live.url + "/acelora/info").json()
        assert info["base_weight_bytes"] > 0 and info["max_loras"] == 32
    finally:
        live.close()
        app.state.server.engine.close()


def test_model_adapters_and_pool_options(demo) -> None:
    args = build_parser().parse_args(["--model", str(demo.base_dir), "--served-model-name", "tiny",
                                      "--adapters", str(demo.adapters_dir), "--max-cpu-loras", "2",
                                      "--max-loras", "1", "--enable-runtime-lora"])  # fmt: skip
    app, what = build_app(args)
    server = app.state.server
    try:
        largest = max(p.joinpath("adapter_model.safetensors").stat().st_size for p in demo.adapters.values())
        assert what == "tiny + 5 adapters" and server.allow_runtime_lora and server.engine.max_loras == 1
        assert 2 * largest <= server.engine.pool.stats()["bytes_capacity"] < 3 * largest
    finally:
        server.engine.close()


def test_lora_modules_must_be_name_equals_absolute_path(demo) -> None:
    path = demo.adapters["med-qa-v1"]
    assert static_adapters(None, [f"doc-v1={path}"]) == {"doc-v1": path}
    for bad in ["doc-v1", "doc-v1=relative/dir", f"../x={path}", "doc-v1=/no/such/adapter"]:
        with pytest.raises(ServeArgumentError, match="--lora-modules"):
            static_adapters(None, [bad])


@pytest.mark.parametrize(
    "argv",
    [
        ["--adapters", "/nonexistent"],
        ["--model", "/nonexistent/model"],
        ["--lora-modules", "doc-v1"],
        ["--lora-modules", "doc-v1=/nonexistent"],
        ["--allowed-adapter-root", "/nonexistent"],
    ],
)
def test_a_bad_path_argument_exits_2_with_one_line_not_a_traceback(argv, tmp_path) -> None:
    argv = [a.replace("/nonexistent", str(tmp_path / "nope")) for a in argv]
    out = subprocess.run([sys.executable, "-m", "acelora_kernels.server", *argv], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("acelora serve: error:")]
    assert len(errors) == 1 and argv[0] in errors[0] and "Traceback" not in out.stderr


def test_model_directory_that_is_not_a_model_exits_2(tmp_path, capsys) -> None:
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("acelora serve: error: --model")


def test_adapters_with_files_symlinked_out_of_the_directory_are_skipped(demo, tmp_path, capsys) -> None:
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    shutil.copytree(demo.adapters["med-qa-v1"], outside / "secret")
    shutil.copytree(demo.adapters["med-qa-v1"], root / "ok-v1")
    for name, file in [("st-link", "adapter_model.safetensors"), ("cfg-link", "adapter_config.json")]:
        shutil.copytree(demo.adapters["med-qa-v1"], root / name)
        (root / name / file).unlink()
        (root / name / file).symlink_to(outside / "secret" / file)
    (root / "dir-link").symlink_to(outside / "secret")
    assert static_adapters(root, []) == {"ok-v1": root.resolve() / "ok-v1"}
    warnings = capsys.readouterr().err
    assert all(f"skipping adapter '{n}'" in warnings for n in ("st-link", "cfg-link", "dir-link"))


def test_lora_prefetch_hint_loads_an_adapter_without_using_it(demo) -> None:
    eng = make_engine(demo)
    live = LiveServer(create_app(eng, TINY_MODEL_NAME))
    try:
        assert "brand-voice-v1" not in eng.pool
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=2,
                                       extra_body={"lora_prefetch": ["brand-voice-v1", "no-such-adapter"]})  # fmt: skip
        deadline = time.monotonic() + 30
        while "brand-voice-v1" not in eng.pool and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "brand-voice-v1" in eng.pool
    finally:
        live.close()
        eng.close()


def test_completions_accept_token_id_prompts_and_reject_out_of_vocabulary_ids(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ids = list(b"hello") + [260]
    out = client.completions.create(model=TINY_MODEL_NAME, prompt=ids, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY_MODEL_NAME, prompt=[1, 99999], max_tokens=3)


def test_lora_prefetch_only_loads_registered_names_and_ignores_anything_else(demo, tmp_path) -> None:
    eng = make_engine(demo)
    live = LiveServer(create_app(eng, TINY_MODEL_NAME))
    try:
        url = live.url + "/v1/chat/completions"
        other = str(demo.adapters["brand-voice-v1"])
        for hint in [other, [other, "../brand-voice-v1", "no-such-adapter"], {"name": other}, [1, None], 7]:
            body = {"model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 1, "lora_prefetch": hint}
            assert httpx.post(url, json=body, timeout=60).status_code == 200  # ignored, not a 400
        assert not any(n.startswith("/") or ".." in n for n in eng.pool.resident())
    finally:
        live.close()
        eng.close()

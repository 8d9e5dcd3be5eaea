"""``acelora gateway --config`` as a user starts it: a real process, a TOML config, keys from the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gateway_command_serves_the_config(tmp_path, upstream):
    (tmp_path / "adapters").mkdir()
    config = tmp_path / "acelora.toml"
    config.write_text(f"""
mode = "prod"
base_model = "tiny-llama"

[registry]
roots = ["adapters"]

[tenants.tenant_dev_01]
api_key_env = "ACELORA_TEST_TENANT_KEY"

[[servers]]
name = "vllm-primary"
endpoint = "{upstream.url}"
kind = "vllm"

[gateway]
admin_key_env = "ACELORA_TEST_ADMIN_KEY"
""")
    port = _free_port()
    env = {**os.environ, "ACELORA_TEST_TENANT_KEY": "sk-dev", "ACELORA_TEST_ADMIN_KEY": "sk-admin"}
    proc = subprocess.Popen([sys.executable, "-m", "acelora", "gateway", "--config", str(config), "--port", str(port),
                             "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer sk-dev"},
                       json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
        fleet = httpx.get(f"{url}/v1/fleet", headers={"authorization": "Bearer sk-admin"}).json()["data"]
        assert fleet[0]["name"] == "vllm-primary" and fleet[0]["runtime_loading"] is True  # probed at startup
    finally:
        proc.terminate()
        proc.wait(timeout=10)

"""Runtime adapter loading: vLLM's routes, status codes, messages, and the path rules on top."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from engine_support import CHAT, wire
from peft_factory import save_peft_adapter, tiny_llama

from acelora_kernels.tiny import TINY_MODEL_NAME, tiny_model


def _load(server, name: str, path: str, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      timeout=60)  # fmt: skip


def _recorded(fixture: str, old: str, new: str) -> dict:
    """A recorded vLLM error body with the adapter name in its message swapped."""
    body = wire(fixture)["response"]["json"]
    body["error"]["message"] = body["error"]["message"].replace(old, new)
    return body


def _unload(server, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_load_use_list_and_unload_an_adapter_at_runtime(server, demo, extra_root) -> None:
    path = extra_root / "med-copy-v1"
    shutil.copytree(demo.adapters["med-qa-v1"], path)
    ok = _load(server, "med-copy-v1", str(path))
    assert (ok.status_code, ok.text) == (
        200,
        wire("vllm__load_ok")["response"]["text"].replace("code-python-v2", "med-copy-v1"),
    )
    assert "content-type" not in ok.headers
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="med-copy-v1", messages=CHAT, temperature=0, max_tokens=40)
    assert out.model == "med-copy-v1" and out.choices[0].message.content.startswith("[med]")
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["med-copy-v1"]["root"] == str(path) and cards["med-copy-v1"]["parent"] == TINY_MODEL_NAME

    dup = _load(server, "med-copy-v1", str(path))
    assert (dup.status_code, dup.json()) == (
        400,
        _recorded("vllm__load_duplicate", "code-python-v2", "med-copy-v1"),
    )
    assert _load(server, "med-copy-v1", str(path), load_inplace=True).status_code == 200

    gone = _unload(server, "med-copy-v1")
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'med-copy-v1' removed successfully.")
    again = _unload(server, "med-copy-v1")
    assert again.status_code == 404
    assert again.json() == _recorded("vllm__unload_unknown", "legal-compliance-v1", "med-copy-v1")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="med-copy-v1", messages=CHAT, max_tokens=4)


def test_missing_adapter_path_is_404_with_the_path_redacted(server, extra_root) -> None:
    r = _load(server, "legal-compliance-v2", str(extra_root / "legal-compliance-v2"))
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "Loading lora legal-compliance-v2 failed: No adapter found for <path>",
        "type": "NotFoundError", "param": None, "code": 404,
    }  # fmt: skip


def test_incompatible_adapters_are_500_and_not_registered(server, extra_root) -> None:
    big = save_peft_adapter(tiny_model(), extra_root / "rank-128", r=128)
    other = save_peft_adapter(tiny_llama(hidden=32, intermediate=64), extra_root / "other-model")
    for name, path, why in [("rank-128", big, "LoRA rank 128 is greater than max_lora_rank 64."),
                            ("other-model", other, "other hidden size")]:  # fmt: skip
        r = _load(server, name, str(path))
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("InternalServerError", None, 500)
        assert err["message"].startswith("Call to add_lora method failed: ") and why in err["message"]
        assert str(extra_root) not in err["message"]
        assert name not in [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"lora_name": "", "lora_path": ""}, 400),
        ({"lora_name": "x-v1", "lora_path": "relative/x-v1"}, 400),
        ({"lora_name": "x-v1", "lora_path": "org/hub-repo"}, 400),
        ({"lora_name": "x-v1", "lora_path": "/etc"}, 400),
        ({"lora_name": "../etc", "lora_path": "/etc"}, 400),
        ({"lora_name": TINY_MODEL_NAME, "lora_path": "/etc"}, 400),
        ({"lora_name": 5, "lora_path": "/etc"}, 400),
    ],
)
def test_unsafe_or_empty_loads_are_refused_with_400(server, body, status) -> None:
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_symlink_out_of_the_adapter_root_is_refused(server, demo, extra_root, tmp_path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(demo.adapters["fin-analyst-v1"], outside)
    (extra_root / "sneaky").symlink_to(outside)
    r = _load(server, "sneaky", str(extra_root / "sneaky"))
    assert r.status_code == 400 and "outside the allowed" in r.json()["error"]["message"]


def test_disabled_runtime_loading_is_a_plain_404_like_vllm(locked_server, demo) -> None:
    fx = wire("vllm__load_runtime_disabled")
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(locked_server.url + path, json={"lora_name": "x", "lora_path": str(demo.adapters_dir)})
        assert (r.status_code, r.json()) == (fx["response"]["status"], fx["response"]["json"])
    client = openai.OpenAI(base_url=locked_server.url + "/v1", api_key="unused", max_retries=0)
    assert client.chat.completions.create(model="med-qa-v1", messages=CHAT, temperature=0,
                                          max_tokens=8).choices[0].message.content.startswith("[med]")  # fmt: skip


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "adapter_config.json"])
def test_load_refuses_an_adapter_whose_files_are_symlinked_out_of_the_allowed_root(
    server, demo, extra_root, tmp_path, file
) -> None:
    outside = tmp_path / "outside-secret"
    shutil.copytree(demo.adapters["legal-compliance-v1"], outside)
    linked = extra_root / f"link-{file.split('.')[0].replace('_', '-')}"
    shutil.copytree(demo.adapters["med-qa-v1"], linked)
    (linked / file).unlink()
    (linked / file).symlink_to(outside / file)
    name = linked.name
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(linked)})
    err = r.json()["error"]
    assert (r.status_code, err["type"]) == (400, "InvalidUserInput")
    assert "outside the allowed adapter directories" in err["message"] and str(tmp_path) not in err["message"]
    assert name not in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]

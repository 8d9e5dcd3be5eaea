import pytest

from acelora import Mode, MultiLoRA
from acelora.errors import ConfigError

GOOD = """
mode = "shadow"
on_unknown = "reject"
base_model = "meta-llama/Llama-3.3-70B-Instruct"

[registry]
roots = ["adapters"]

[tenants.tenant_dev_01]
adapters = ["code-python-v2"]
api_key_env = "TEST_KEY_DEV01"

[[servers]]
name = "vllm-primary"
endpoint = "http://gpu1:8000"
kind = "vllm"
base_model = "meta-llama/Llama-3.3-70B-Instruct"
max_lora_rank = 16
api_key_env = "VLLM_KEY"

[gateway]
admin_key_env = "TEST_ADMIN_KEY"
"""


@pytest.fixture()
def config_dir(tmp_path, peft_root):
    (tmp_path / "adapters").symlink_to(peft_root, target_is_directory=True)
    return tmp_path


def write(d, text):
    p = d / "acelora.toml"
    p.write_text(text)
    return p


def test_a_full_config_builds_the_skill(config_dir, monkeypatch):
    monkeypatch.setenv("TEST_KEY_DEV01", "sk-dev-01")
    monkeypatch.setenv("TEST_ADMIN_KEY", "sk-admin")
    monkeypatch.delenv("ACELORA_MODE", raising=False)
    skill = MultiLoRA.from_config(str(write(config_dir, GOOD)))
    assert skill.mode is Mode.SHADOW and skill.on_unknown == "reject"
    assert len(skill.registry) == 3
    assert skill.registry.is_allowed("tenant_dev_01", "code-python-v2")
    assert not skill.registry.is_allowed("someone_else", "code-python-v2")
    assert skill.api_keys == {"sk-dev-01": "tenant_dev_01"} and skill.admin_key == "sk-admin"
    server = skill.fleet.get("vllm-primary")
    assert server.max_lora_rank == 16 and server.api_key_env == "VLLM_KEY"
    assert "sk-" not in str(server.public_dict())


def test_environment_overrides_the_mode(config_dir, monkeypatch):
    monkeypatch.setenv("TEST_KEY_DEV01", "k")
    monkeypatch.setenv("TEST_ADMIN_KEY", "a")
    monkeypatch.setenv("ACELORA_MODE", "prod")
    assert MultiLoRA.from_config(str(write(config_dir, GOOD))).mode is Mode.PROD


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('mode = "loud"', "mode"),
        ('on_unknown = "ignore"', "on_unknown"),
        ('[registry]\nroots = ["nowhere"]', "registry.roots[0]"),
        ('[registry]\nrootz = ["adapters"]', "registry.rootz"),
        ('[[servers]]\nname = "x"\nendpoint = "http://a"\nkind = "tgi"', "servers.0.kind"),
        ('[[servers]]\nname = "x"\nendpoint = "gpu1:8000"', "servers"),
        ('[[servers]]\nendpoint = "http://a"', "servers.0.name"),
        ('[tenants.t1]\nadapters = ["a"]\napi_key_env = "SURELY_UNSET_VAR_123"', "tenants.t1.api_key_env"),
        ("mode = ", "not valid TOML"),
    ],
)
def test_invalid_config_gives_one_clear_error_naming_the_key(tmp_path, text, key, monkeypatch):
    monkeypatch.delenv("ACELORA_MODE", raising=False)
    with pytest.raises(ConfigError) as e:
        MultiLoRA.from_config(str(write(tmp_path, text)))
    assert key in str(e.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        MultiLoRA.from_config(str(tmp_path / "nope.toml"))


def test_prefetch_settings_reach_the_skill(tmp_path, monkeypatch):
    monkeypatch.delenv("ACELORA_MODE", raising=False)
    assert MultiLoRA.from_config(str(write(tmp_path, "[prefetch]\nmax_hints = 3"))).max_prefetch_hints == 3
    assert MultiLoRA.from_config(str(write(tmp_path, "[prefetch]\nenabled = false"))).max_prefetch_hints == 0
    with pytest.raises(ConfigError, match="prefetch.top_k"):
        MultiLoRA.from_config(str(write(tmp_path, "[prefetch]\ntop_k = 3")))

import pytest

from acelora import AdapterRegistry, AdapterSpec, Fleet, Mode, ModelServer, MultiLoRA, RouteRequest
from acelora.errors import ConfigError, InvalidRequest

BASE = "meta-llama/Llama-3.3-70B-Instruct"


def make_skill(mode="prod", servers=None, **kw):
    reg = AdapterRegistry(
        [
            AdapterSpec(name="code-python-v2", path="/a/code", rank=8, base_model=BASE, size_bytes=4_000_000),
            AdapterSpec(name="med-qa-v1", path="/a/med", rank=16, base_model=BASE),
            AdapterSpec(name="big-v1", path="/a/big", rank=64, base_model=BASE),
            AdapterSpec(name="rslora-v1", path="/a/rs", rank=8, use_rslora=True, base_model=BASE),
            AdapterSpec(name="mistral-v1", path="/a/mi", rank=8, base_model="mistralai/Mistral-7B-v0.3"),
        ],
        grants={"tenant_dev_01": ["code-python-v2"]},
    )
    if servers is None:
        servers = [ModelServer(name="vllm-primary", endpoint="http://gpu1:8000", kind="vllm", base_model=BASE,
                               max_lora_rank=16, base_model_bytes=140 * 10**9)]
    return MultiLoRA(registry=reg, fleet=Fleet(servers), mode=mode, **kw)


def route(skill, **kw):
    return skill.route(RouteRequest(**kw))


def test_prod_rewrites_to_the_adapter_and_strips_acelora_fields():
    skill = make_skill()
    d = route(skill, model=BASE, lora_name="med-qa-v1")
    assert (d.action, d.adapter, d.model, d.server.name) == ("adapter_cold_loaded_applied", "med-qa-v1", "med-qa-v1",
                                                              "vllm-primary")
    assert d.needs_load and not d.resident
    body = {"model": BASE, "lora_name": "med-qa-v1", "adapter_rank": 16, "lora_prefetch": True,
            "extra_body": {"lora_name": "med-qa-v1", "top_k": 5}, "messages": [], "temperature": 0}
    out = d.apply(body)
    assert out == {"model": "med-qa-v1", "messages": [], "temperature": 0, "top_k": 5}
    assert body["lora_name"] == "med-qa-v1"  # the caller's body is not mutated


def test_resident_adapter_is_a_prefetch_hit():
    skill = make_skill()
    skill.fleet.mark_resident("vllm-primary", "med-qa-v1")
    d = route(skill, model="med-qa-v1")
    assert d.action == "adapter_prefetched_applied" and d.resident and not d.needs_load
    d2 = route(skill, model="med-qa-v1", resident=False)  # the caller's residency wins until the fleet knows better
    assert d2.action == "adapter_cold_loaded_applied"


def test_shadow_checks_everything_but_changes_nothing():
    skill = make_skill(mode="shadow")
    d = route(skill, model="med-qa-v1")
    assert d.action == "would_load_lora" and d.resident is False and d.fallback_reason is None
    body = {"model": "med-qa-v1", "lora_name": "x"}
    assert d.apply(body) is body
    bad = route(skill, model=BASE, lora_name="nope")
    assert bad.action == "would_load_lora" and bad.fallback_reason == "unknown_adapter"


def test_off_is_not_consulted():
    skill = make_skill(mode="off")
    d = route(skill, model="med-qa-v1", lora_name="../../etc")
    assert d.action is None and d.mode is Mode.OFF
    body = {"model": "med-qa-v1", "lora_name": "../../etc"}
    assert d.apply(body) is body
    assert skill.record(d) is None and len(skill.traces) == 0


def test_per_request_override_beats_the_skill_mode():
    skill = make_skill(mode="off")
    req = RouteRequest.from_body({"model": "med-qa-v1"}, {"x-ace-skill-override": "multi_lora=prod"})
    assert skill.route(req).action == "adapter_cold_loaded_applied"
    with pytest.raises(InvalidRequest):
        RouteRequest.from_body({"model": "m"}, {"x-ace-skill-override": "multi_lora=banana"})


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        (dict(model=BASE, lora_name="../etc/passwd"), "invalid_name"),
        (dict(model=f"{BASE}:a/../../b"), "invalid_name"),
        (dict(model=BASE, lora_name="no-such-adapter"), "unknown_adapter"),
        (dict(model="no-such-adapter"), "unknown_adapter"),
        (dict(model="code-python-v2", tenant="tenant_other"), "unknown_adapter"),
        (dict(model="code-python-v2"), "unknown_adapter"),
        (dict(model="mistral-v1"), "incompatible_base"),
        (dict(model="big-v1"), "unsupported_by_engine"),
    ],
)
def test_every_fallback_reason_goes_to_the_base_model(kw, reason):
    skill = make_skill()
    d = route(skill, **kw)
    assert d.action == "fallback_base_model" and d.fallback_reason == reason
    assert d.model == BASE and not d.needs_load
    event = skill.record(d)
    assert event.fallback_reason == reason and event.action == "fallback_base_model"


def test_forbidden_adapter_is_indistinguishable_from_an_unknown_one():
    skill = make_skill()
    forbidden = skill.record(route(skill, model=BASE, lora_name="code-python-v2", tenant="evil"))
    unknown = skill.record(route(skill, model=BASE, lora_name="code-python-v3", tenant="evil"))
    strip = lambda e: {k: v for k, v in e.to_dict().items() if k not in ("adapter_name", "timestamp", "overhead_ms")}  # noqa: E731
    assert strip(forbidden) == strip(unknown)
    allowed = route(skill, model=BASE, lora_name="code-python-v2", tenant="tenant_dev_01")
    assert allowed.applied


def test_on_unknown_reject_refuses_only_unknown_and_invalid_names():
    skill = make_skill(on_unknown="reject")
    assert route(skill, model="nope").reject
    assert route(skill, model=BASE, lora_name="../x").reject
    big = route(skill, model="big-v1")
    assert not big.reject and big.fallback_reason == "unsupported_by_engine"


def test_sglang_gets_base_colon_adapter_and_never_patterned_adapters():
    sg = ModelServer(name="sg", endpoint="http://sg:30000", kind="sglang", base_model=BASE, max_lora_rank=64)
    skill = make_skill(servers=[sg])
    d = route(skill, model=BASE, lora_name="code-python-v2", tenant="tenant_dev_01")
    assert d.model == f"{BASE}:code-python-v2"
    assert route(skill, model="rslora-v1").fallback_reason == "unsupported_by_engine"
    assert route(skill, model=f"{BASE}:med-qa-v1").model == f"{BASE}:med-qa-v1"


def test_affinity_prefers_the_server_where_the_adapter_is_resident():
    servers = [ModelServer(name=f"s{i}", endpoint=f"http://s{i}:8000", kind="vllm", base_model=BASE) for i in range(4)]
    skill = make_skill(servers=servers)
    first = route(skill, model="med-qa-v1").server.name
    assert all(route(skill, model="med-qa-v1").server.name == first for _ in range(5))  # rendezvous is stable
    other = next(s for s in servers if s.name != first)
    other.resident.add("med-qa-v1")
    assert route(skill, model="med-qa-v1").server is other
    spread = {route(skill, model=n).server.name for n in ("code-python-v2", "big-v1", "rslora-v1", "med-qa-v1")}
    assert len(spread) >= 2


def test_plain_base_requests_are_not_adapter_decisions():
    skill = make_skill()
    d = route(skill, model=BASE)
    assert d.action is None and d.server.name == "vllm-primary"
    assert d.apply({"model": BASE, "lora_prefetch": True}) == {"model": BASE}


def test_without_a_fleet_the_skill_engine_rules_apply():
    reg = AdapterRegistry([AdapterSpec(name="a", path="/a", rank=32)])
    skill = MultiLoRA(registry=reg, mode="prod", engine="vllm", max_lora_rank=16)
    assert route(skill, model="a").fallback_reason == "unsupported_by_engine"
    assert route(skill, model="gpt-4o").action is None  # unknown bases pass through untouched
    ok = MultiLoRA(registry=reg, mode="prod")
    d = route(ok, model="base", lora_name="a")
    assert d.applied and d.model == "a" and d.server is None


def test_trace_figures_are_derived_from_measurements_only():
    skill = make_skill()
    skill.fleet.mark_resident("vllm-primary", "code-python-v2")
    d = route(skill, model="code-python-v2", tenant="tenant_dev_01")
    e = skill.record(d)
    assert e.swap_ms == 0.0 and e.swap_ms_saved is None  # nothing measured yet: no invented saving
    assert e.vram_mb_saved == round((140 * 10**9 - 4_000_000) / 2**20, 3)
    skill.observe_load("code-python-v2", 80.0, 4_000_000)
    e2 = skill.record(route(skill, model="code-python-v2", tenant="tenant_dev_01"))
    assert e2.swap_ms_saved == 80.0 and e2.is_prefetch_hit is True and e2.adapter_hash
    assert b'acelora_multi_lora_requests_total{action="adapter_prefetched_applied"' in skill.metrics.render()


def test_bad_constructor_arguments_raise_config_errors():
    with pytest.raises(ConfigError):
        MultiLoRA(mode="loud")
    with pytest.raises(ConfigError):
        MultiLoRA(on_unknown="ignore")
    with pytest.raises(ConfigError):
        ModelServer(name="x", endpoint="gpu1:8000")


def test_a_failed_load_turns_into_a_load_failed_fallback():
    skill = make_skill()
    d = route(skill, model=BASE, lora_name="med-qa-v1").fall_back("load_failed")
    assert (d.action, d.fallback_reason, d.model) == ("fallback_base_model", "load_failed", BASE)
    bare = MultiLoRA(registry=AdapterRegistry([AdapterSpec(name="a", path="/a")]), mode="prod")
    d2 = bare.route(RouteRequest(model="my-base", lora_name="a")).fall_back("load_failed")
    assert d2.apply({"model": "my-base", "lora_name": "a"}) == {"model": "my-base"}


def test_a_bad_lora_name_never_lets_model_select_another_tenants_adapter():
    skill = make_skill(servers=[])  # no fleet and no configured base: the base is unknown
    for kw in (dict(model="code-python-v2", lora_name="nope"), dict(model="code-python-v2", lora_name="../x"),
               dict(model=f"{BASE}:code-python-v2", lora_name="nope")):
        d = route(skill, tenant="intruder", **kw)
        assert d.reject and d.action == "rejected", kw
    ok = route(skill, model="my-base", lora_name="nope", tenant="intruder")
    assert ok.action == "fallback_base_model" and ok.apply({"model": "my-base", "lora_name": "nope"}) == {"model": "my-base"}


def test_shadow_never_runs_another_tenants_adapter_but_leaves_the_rest_untouched():
    skill = make_skill(mode="shadow")
    d = route(skill, model="code-python-v2", tenant="intruder")
    assert d.action == "would_load_lora" and d.fallback_reason == "unknown_adapter"
    assert d.apply({"model": "code-python-v2", "temperature": 0}) == {"model": BASE, "temperature": 0}
    mine = route(skill, model="code-python-v2", tenant="tenant_dev_01")
    body = {"model": "code-python-v2"}
    assert mine.apply(body) is body


def test_failed_load_without_a_known_base_is_refused_not_guessed():
    skill = make_skill(servers=[])
    d = route(skill, model="med-qa-v1", tenant="t").fall_back("load_failed")
    assert d.reject and d.fallback_reason == "load_failed"


def test_null_lora_name_falls_through_to_extra_body():
    req = RouteRequest.from_body({"model": BASE, "lora_name": None, "extra_body": {"lora_name": "med-qa-v1"}})
    assert req.lora_name == "med-qa-v1"


def test_a_server_endpoint_given_with_v1_still_loads_at_the_root():
    s = ModelServer(name="s", endpoint="http://gpu1:8000/v1/", kind="vllm")
    assert s.endpoint == "http://gpu1:8000" and s.openai_base_url == "http://gpu1:8000/v1"

"""The engines' facts registry: what an engine states is read by role, a contradiction is refused by name, and a
missing registration says what to do rather than sizing with nothing."""

from __future__ import annotations

import pytest

from pytest_kvprofile.matrix import engine_facts as ef
from pytest_kvprofile.matrix.engine_facts import EngineFacts, FloatWorkspaceRule, RoutePolicy, TrtllmOnly
from pytest_kvprofile.matrix.kv_dtypes import kv_dtype
from pytest_kvprofile.units import MiB

POLICY = RoutePolicy(decode_tensor_cores_min_group=4,
                     trtllm_only={"nvfp4": TrtllmOnly((10,), "the engine reads it with FA2 elsewhere")})
ENGINE_A = EngineFacts("engine-a", {"bf16": "auto"}, (FloatWorkspaceRule("a-default", 100 * MiB, 16),),
                       route_policy=POLICY)
ENGINE_B = EngineFacts("engine-b", {"bf16": "bfloat16"}, (FloatWorkspaceRule("b-default", 50 * MiB),))


@pytest.fixture
def empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ef, "_ENGINES", {})
    monkeypatch.setattr(ef, "_FALLBACK", [])


@pytest.mark.usefixtures("empty")
def test_facts_are_read_by_role():
    ef.register_engine_facts(ENGINE_A)
    ef.register_engine_facts(ENGINE_B)
    ef.register_engine_facts(ENGINE_A)  # configure again in one process: a no-op
    assert ef.registered_engines() == (ENGINE_A, ENGINE_B)
    assert ef.route_policy() is POLICY
    assert [r.name for r in ef.workspace_rules()] == ["a-default", "b-default"]
    assert ef.workspace_rule("a-default").bytes_for(8192, 32, 128) == 8192 * 32 * 128 * 16
    assert ef.workspace_rule("a-default").bytes_for(16, 32, 128) == 100 * MiB
    assert ef.engine_facts("engine-b").kv_cache_dtype("bf16") == "bfloat16"
    assert ef.engine_facts("engine-b").kv_cache_dtype("nvfp4") is None


@pytest.mark.usefixtures("empty")
def test_the_route_policy_decides_decode_planner_and_trtllm_only_layouts():
    ef.register_engine_facts(ENGINE_A)
    assert POLICY.decode_tensor_cores(32, 8, 0) and not POLICY.decode_tensor_cores(16, 8, 0)
    assert POLICY.decode_tensor_cores(16, 8, 1)  # always under MTP
    nvfp4 = kv_dtype("nvfp4")
    assert nvfp4.fa2_refusal((10, 0)) == ("KV dtype nvfp4 runs on FlashInfer's trtllm-gen kernels only on sm_100 "
                                          "(the engine reads it with FA2 elsewhere)")
    assert nvfp4.fa2_refusal((11, 0)) is None  # this engine's policy names SM10x alone
    assert kv_dtype("bf16").fa2_refusal((10, 0)) is None


@pytest.mark.usefixtures("empty")
def test_contradictions_are_refused_by_name():
    ef.register_engine_facts(ENGINE_A)
    with pytest.raises(ValueError, match="two engines state facts as 'engine-a'"):
        ef.register_engine_facts(EngineFacts("engine-a", {}))
    with pytest.raises(ValueError, match="float workspace 'a-default', which engine 'engine-a' names"):
        ef.register_engine_facts(EngineFacts("engine-c", {}, (FloatWorkspaceRule("a-default", 1),)))
    with pytest.raises(ValueError, match="engine 'engine-d' states a route policy, and engine 'engine-a' does"):
        ef.register_engine_facts(EngineFacts("engine-d", {}, route_policy=POLICY))
    assert ef.registered_engines() == (ENGINE_A,)


@pytest.mark.usefixtures("empty")
def test_nothing_registered_says_what_to_do():
    with pytest.raises(LookupError, match="no registered engine states a route policy.*builtin_registry"):
        ef.route_policy()
    with pytest.raises(LookupError, match="no engine names a float workspace 'vllm-default'"):
        ef.workspace_rule("vllm-default")
    with pytest.raises(LookupError, match="no engine states facts as 'vllm'"):
        ef.engine_facts("vllm")
    with pytest.raises(LookupError, match="route policy"):
        kv_dtype("nvfp4").fa2_refusal((10, 0))  # never sized as if no engine routed it to trtllm-gen


def test_the_run_sizes_under_the_registered_engines_facts():
    """In a pytest run the plugin has registered the package's engines at configure."""
    names = [f.name for f in ef.registered_engines()]
    assert {"vllm", "sglang"} <= set(names)
    assert ef.route_policy() is ef.engine_facts("vllm").route_policy
    assert ef.workspace_rule("vllm-default").fixed_bytes == 394 * MiB
    assert ef.workspace_rule("sglang").fixed_bytes == 384 * MiB


@pytest.mark.usefixtures("empty")
def test_the_report_order_of_engine_workspaces_is_not_the_registration_order():
    from pytest_kvprofile.sizing.rules import fixed_sizes

    ef.register_engine_facts(ENGINE_B)
    ef.register_engine_facts(ENGINE_A)
    assert list(fixed_sizes()) == ["flashinfer-default", "a-default", "b-default", "tensorrt-llm"]


def test_a_program_without_pytest_sizes_under_the_package_engines(monkeypatch: pytest.MonkeyPatch):
    """Nothing registered, the package's fallback registers its own engines through their hooks on first lookup."""
    monkeypatch.setattr(ef, "_ENGINES", {})
    assert ef.route_policy().decode_tensor_cores_min_group == 4
    assert {f.name for f in ef.registered_engines()} == {"vllm", "sglang"}

"""Isolation between cases: a leak is blamed in the case that made it and changes nothing after it."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from pytest_kvprofile import Backend
from pytest_kvprofile import lifecycle as lc
from pytest_kvprofile.checks import failing_checks
from pytest_kvprofile.isolation import leftover_allocations, leftover_violations
from pytest_kvprofile.matrix import load_matrix_text
from pytest_kvprofile.stubs import STUB_BACKENDS, FlashInferLikeBuilder

MiB = 1 << 20
MATRIX = """\
envelope: {num_ubatches: 2}
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096}
gpus: [L40S]
tp: [1]
gmu: [0.9, 0.98]
"""
CASE_K, CASE_K1 = load_matrix_text(MATRIX, "two-cases.yaml").cases
LEAKED: list[Any] = []  # module-global state that outlives a case, as a leaking backend keeps it


class LeaksInCaseK(FlashInferLikeBuilder):
    """Correct, except that in case K its first dummy run parks 4 MiB in a module-global list."""

    name = "leaky"

    def dummy_run(self, ctx: Any) -> None:
        super().dummy_run(ctx)
        if ctx.case.id == CASE_K.id and not getattr(self, "leaked", False):
            self.leaked = True
            LEAKED.append(ctx.allocate(4 * MiB, "module-global scratch"))


class DropsWithoutFree(FlashInferLikeBuilder):
    """Allocates in rebind and forgets the handle without freeing it."""

    name = "forgetful"

    def rebind(self, ctx: Any) -> None:
        super().rebind(ctx)
        ctx.allocate(2 * MiB, "forgotten")


class KeepsOnInstance(FlashInferLikeBuilder):
    """Holds an extra buffer on the instance: dropping the builder frees it, so it is no leftover."""

    name = "holder"

    def rebind(self, ctx: Any) -> None:
        super().rebind(ctx)
        if not hasattr(self, "extra"):
            self.extra = {"buffers": [ctx.allocate(2 * MiB, "instance buffer")]}


class ClassCache(FlashInferLikeBuilder):
    """Caches a buffer on the class: it outlives every case."""

    name = "class-cache"
    cache: ClassVar[dict[str, Any]] = {}

    def warmup(self, ctx: Any) -> None:
        super().warmup(ctx)
        if ctx.case.id not in self.cache:
            self.cache[ctx.case.id] = ctx.allocate(1 * MiB, "class-level cache")


def backend(cls: type) -> Backend:
    return Backend(name=cls.name, make_builders=lambda case: [cls(case)])


def run(b: Backend, case: Any) -> tuple[Any, Any]:
    """One lifecycle run with the harness's own device factory; returns the result and its device."""
    devices: list[Any] = []

    def factory(c: Any) -> Any:
        devices.append(lc.make_device(c))
        return devices[-1]

    return lc.run_lifecycle(b, case, factory), devices[0]


@pytest.fixture(autouse=True)
def _clean_globals() -> None:
    LEAKED.clear()
    ClassCache.cache.clear()


def test_a_case_k_leak_is_blamed_in_k_and_changes_nothing_in_k_plus_1() -> None:
    leaky = backend(LeaksInCaseK)
    result_k, device_k = run(leaky, CASE_K)
    result_k1, device_k1 = run(leaky, CASE_K1)
    reference, _ = run(STUB_BACKENDS[0], CASE_K1)

    blamed = leftover_allocations(result_k, device_k)
    assert [(x.owner, x.tag, x.nbytes, x.phase, x.origin, x.reason) for x in blamed] == [
        ("leaky", "module-global scratch", 4 * MiB, lc.PROFILE_RUN, "dummy_run", "held by module or class state")
    ]
    assert device_k is not device_k1
    assert leftover_allocations(result_k1, device_k1) == []
    assert failing_checks(result_k1) == failing_checks(reference) == {}
    assert result_k1.budget == reference.budget  # case K+1 sizes exactly as if case K had never leaked


def test_a_correct_backend_leaves_nothing_but_what_teardown_frees() -> None:
    for stub in STUB_BACKENDS:
        for case in (CASE_K, CASE_K1):
            result, device = run(stub, case)
            assert leftover_allocations(result, device) == [], (stub.name, case.id)
            # teardown accounts for every allocated byte: the engine's memory and what the builders hold
            freed = sum(a.size for a in device.live_allocations()
                        if a.kind == "device" and a.owner in ("model", "kv-cache", "workspace-manager", *result.builder_names()))
            assert freed == device.memory_allocated() > 0


@pytest.mark.parametrize(
    ("cls", "tag", "reason"),
    [
        (DropsWithoutFree, "forgotten", "unreferenced"),
        (ClassCache, "class-level cache", "held by module or class state"),
    ],
)
def test_leftovers_name_owner_tag_phase_and_why(cls: type, tag: str, reason: str) -> None:
    result, device = run(backend(cls), CASE_K)
    messages = leftover_violations(result, device)
    assert messages and all(f"{cls.name}: {tag!r}" in m and f"({reason})" in m for m in messages), messages


def test_memory_the_builder_itself_holds_is_freed_with_it() -> None:
    result, device = run(backend(KeepsOnInstance), CASE_K)
    assert any(a.tag == "instance buffer" and a.alive for a in result.allocations)
    assert leftover_allocations(result, device) == []


def test_memory_from_an_earlier_run_on_the_same_device_is_reported() -> None:
    leaky = backend(LeaksInCaseK)
    shared = lc.make_device(CASE_K)
    lc.run_lifecycle(leaky, CASE_K, lambda case: shared)
    result = lc.run_lifecycle(STUB_BACKENDS[0], CASE_K1, lambda case: shared)
    reasons = {(x.owner, x.reason) for x in leftover_allocations(result, shared)}
    assert ("leaky", "from an earlier run") in reasons

"""Lifetimes the harness exercises as engines do (issue 37, point 7): the lease released twice (the engine's
release and its ``finally``), and a second engine of the process with a Case object of its own. Each bug is refused
and its correct twin passes."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile import Backend, run_lifecycle
from pytest_kvprofile.builtin.process_state import TorchProcessWorkspaceBuilder
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.protocol import BuilderContext
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix


@pytest.fixture(scope="module")
def case() -> Case:
    return next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")


def run(cls: type, case: Case) -> LifecycleResult:
    return run_lifecycle(Backend(name=cls.__name__, make_builders=lambda c: [cls(c)],
                                 torch_mode=bool(getattr(cls, "torch_mode", False))), case)


class FreeingLease(Lease):
    """A lease whose release frees what it holds every time it is called."""

    def __init__(self, owner: str, ctx: BuilderContext, allocations: list[Any], idempotent: bool):
        super().__init__(owner, allocations)
        self.ctx, self.allocations, self.idempotent = ctx, allocations, idempotent

    def release(self) -> None:
        if self.idempotent and self.released:
            return
        for a in self.allocations:
            self.ctx.free(a)
        super().release()


class FreesOnRelease(FlashInferLikeBuilder):
    """Correct: its lease frees the wrappers' int workspaces once, however often it is released."""

    idempotent = True

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        wrappers = self._materialize(ctx)
        owned = [w.int_workspace for w in wrappers]
        for w in wrappers:
            w.int_workspace = None
        self.wrappers.clear()
        return FreeingLease(self.name, ctx, owned, self.idempotent)


class DoubleFreesOnRelease(FreesOnRelease):
    """Bug: its release is not idempotent; the engine's second release frees the same memory again."""

    idempotent = False


def test_a_lease_released_twice_must_not_double_free(case):
    bad = run(DoubleFreesOnRelease, case)
    assert any(e.phase == "lease_release" for e in bad.errors), bad.errors
    assert failing_checks(bad)
    good = run(FreesOnRelease, case)
    assert not [e for e in good.errors if e.phase == "lease_release"], good.errors


_BY_CASE_OBJECT: dict[int, Any] = {}


class CachesByCaseObject(TorchProcessWorkspaceBuilder):
    """Bug: the process's workspace cached under ``id(case)``: a fresh engine's config is another object, so every
    engine makes its own and the process keeps them all."""

    def _workspace(self) -> Any:
        key = id(self.case)
        if key not in _BY_CASE_OBJECT:
            _BY_CASE_OBJECT[key] = self.place.make(key)
        return _BY_CASE_OBJECT[key]


_BY_CASE_ID: dict[str, Any] = {}


class CachesByCaseId(CachesByCaseObject):
    """Correct twin: cached under what the case is (its id)."""

    def _workspace(self) -> Any:
        if self.case.id not in _BY_CASE_ID:
            _BY_CASE_ID[self.case.id] = self.place.make(self.case.id)
        return _BY_CASE_ID[self.case.id]


def test_the_second_engine_has_its_own_case_object(case):
    bad = run(CachesByCaseObject, case)
    assert bad.second_engine is not None and bad.second_engine.run.case is not case
    assert bad.second_engine.run.case == case
    assert "no_state_outlives_case" in failing_checks(bad), failing_checks(bad)
    good = run(CachesByCaseId, case)
    assert good.second_engine is not None and not failing_checks(good), failing_checks(good)

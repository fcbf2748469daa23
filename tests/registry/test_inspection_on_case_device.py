"""Builders are inspected and classified on the case's device (issue 21, point 4).

A torch-mode backend whose builders make FlashInfer's real wrappers in ``__init__`` used to be constructed
outside the simulated GPU at configure and collection: the verdict recorded "Torch not compiled with CUDA
enabled" as its declaration and said no builder declares REQUIRED, although every check passed. A harness
that cannot set up the device raises as itself; it is never recorded as the backend's declaration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvprofile.builtin.stubs import TorchFlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import PROFILING
from pytest_kvprofile.matrix.schema import load_matrix
from pytest_kvprofile.plugin.session import (
    FACTORY_ERROR,
    Settings,
    build_session,
    parts_on_device,
)
from pytest_kvprofile.registry import inspect_backend
from pytest_kvprofile.units import MiB

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # FlashInfer's cutlass-dsl imports
CI = "matrices/ci.yaml"


class InitWrapperBuilder(TorchFlashInferLikeBuilder):
    """Correct: the torch stub, plus FlashInfer's real prefill wrapper made in ``__init__`` (as vLLM's GDN builder
    makes its CUDA-graph buffers there): before the baseline, so every later measurement sees it."""

    name = "flashinfer-init-wrapper"

    def __init__(self, case: Any):
        import flashinfer
        import torch

        super().__init__(case)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(MiB, dtype=torch.uint8, device="cuda"), "NHD")


def _backend(torch_mode: bool) -> Backend:
    return Backend(name=f"init-wrapper-{'torch' if torch_mode else 'ctx'}",
                   make_builders=lambda c: [InitWrapperBuilder(c)], origin="test", torch_mode=torch_mode)


def _first_case() -> Any:
    return next(c for c in load_matrix(CI).cases if c.skip_reason is None)


def test_a_torch_mode_backend_making_real_wrappers_in_init_declares_required_and_passes():
    backend = _backend(torch_mode=True)
    session = build_session(Settings(matrices=(CI,)), [backend], "cpu")
    case = session.runnable_cases[0]
    assert session.profiles[backend.name].declared_support == {"flashinfer-init-wrapper": "required"}
    assert session.classify(backend, case).path == PROFILING
    result = run_lifecycle(backend, case)
    close_parts(result)
    assert failing_checks(result) == {}


def test_its_twin_outside_torch_mode_is_its_own_factory_error_and_refused():
    """The same builders on a backend that does not ask for torch mode: no simulated GPU is due, so the
    factory's error is the backend's, recorded as such, and every check of the pair fails."""
    backend = _backend(torch_mode=False)
    case = _first_case()
    profile = inspect_backend(backend, case, parts_on_device("cpu"))
    assert profile.declared_support["<factory>"].startswith("error: ")
    session = build_session(Settings(matrices=(CI,)), [backend], "cpu")
    assert session.classify(backend, case).path == FACTORY_ERROR
    assert "support_declaration" in failing_checks(run_lifecycle(backend, case))


def test_a_harness_that_cannot_set_up_the_device_raises_and_records_no_declaration():
    @contextlib.contextmanager
    def broken(backend: Backend, case: Any) -> Iterator[Any]:
        raise RuntimeError("simulated GPU unavailable")
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="simulated GPU unavailable"):
        inspect_backend(_backend(torch_mode=True), _first_case(), broken)

"""The reliability tests run pytester sessions with short ``--kvprofile-timeout``s: build the
oracle (the root conftest's ``oracle_cache``) before any of them starts, so no check's clock
includes seconds of nvcc, where a short limit would turn the build into a reported hang."""

from __future__ import annotations

import pytest

from pytest_kvprofile.attention.oracle import oracle_available


@pytest.fixture(autouse=True)
def _oracle_built_first(request: pytest.FixtureRequest) -> None:
    if oracle_available()[0]:
        request.getfixturevalue("oracle_cache")

"""What the engine drives for one model: a backend's builders, then the persistent resources beside them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_kvprofile.contract.resources import ResourceAdapter
from pytest_kvprofile.lifecycle.resources import case_resources

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case


def model_parts(backend: Backend, case: Case) -> list[Builder]:
    """Everything the engine drives for one model: the backend's builders, then its resources.

    A backend may bring its own resources (``make_resources``); otherwise the case's are used
    (``lifecycle/resources.py``).
    """
    builders = list(backend.make_builders(case))
    make_resources = getattr(backend, "make_resources", None)
    resources = list(make_resources(case)) if make_resources is not None else case_resources(case)
    return builders + [ResourceAdapter(r) for r in resources]

"""Exact FlashInfer workspace sizing: what a backend must reserve for every batch it can plan.

| name | module | what it is |
|---|---|---|
| `for_case`, `plan_envelope`, `decode_tensor_cores`, `routes` | `case` | the one computation of what a matrix case needs |
| `required_workspace`, `SizingResult`, `RouteSizing`, `route_results`, `installed_flashinfer_version` | `requirement` | the requirement for any per-rank layout and envelope |
| `sizing_method`, `SizingMethod` | `requirement` | which method (oracle or analytic) sizes a FlashInfer version here, and why |
| `PlanEnvelope`, `PlanBatch`, `DEFAULT_INT_WORKSPACE` | `analytic` | the batches one `plan()` can see; closed-form worst cases |
| `OracleError`, `OracleUnavailable`, `get_oracle`, `oracle_available` | `attention.oracle` | FlashInfer's own planner compiled for the host (re-exported) |
| `sizing_report`, `report_for_matrix`, `format_report` | `comparison` | the requirement next to the fixed sizes in use |
"""  # noqa: E501 - markdown table rows cannot wrap

from __future__ import annotations

from pytest_kvprofile.attention.oracle import (
    OracleError,
    OracleUnavailable,
    get_oracle,
    oracle_available,
)
from pytest_kvprofile.sizing.analytic import (
    DEFAULT_INT_WORKSPACE,
    PlanBatch,
    PlanEnvelope,
)
from pytest_kvprofile.sizing.case import (
    decode_tensor_cores,
    for_case,
    plan_envelope,
    routes,
)
from pytest_kvprofile.sizing.comparison import (
    format_report,
    report_for_matrix,
    sizing_report,
)
from pytest_kvprofile.sizing.requirement import (
    RouteSizing,
    SizingMethod,
    SizingResult,
    installed_flashinfer_version,
    required_workspace,
    route_results,
    sizing_method,
)

__all__ = [
    "DEFAULT_INT_WORKSPACE",
    "OracleError",
    "OracleUnavailable",
    "PlanBatch",
    "PlanEnvelope",
    "RouteSizing",
    "SizingMethod",
    "SizingResult",
    "decode_tensor_cores",
    "for_case",
    "format_report",
    "get_oracle",
    "installed_flashinfer_version",
    "oracle_available",
    "plan_envelope",
    "report_for_matrix",
    "required_workspace",
    "route_results",
    "routes",
    "sizing_method",
    "sizing_report",
]

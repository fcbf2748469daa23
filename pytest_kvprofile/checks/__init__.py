"""The conformance checks (``catalog``) and plain-loop sweeps of backends over cases (``sweep``)."""

from __future__ import annotations

from pytest_kvprofile.checks.catalog import (
    CHECKS,
    CHECKS_BY_NAME,
    Check,
    CheckOptions,
    checks_for,
    failing_checks,
)

__all__ = ["CHECKS", "CHECKS_BY_NAME", "Check", "CheckOptions", "checks_for", "failing_checks"]

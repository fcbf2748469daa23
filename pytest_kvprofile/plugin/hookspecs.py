"""Hooks pytest-kvprofile adds for engines and backend repositories (registered by the plugin)."""

from __future__ import annotations

from typing import Any


def pytest_kvprofile_backends(config: Any) -> Any:
    """Return a Backend (or a list of them) to run the suite against; called once at configure.

    Implement it in a conftest.py to register a backend without packaging it.
    """


def pytest_kvprofile_update_json(config: Any, report: dict[str, Any]) -> None:
    """Add fields to the JSON report and the verdict document before they are written (controller only)."""

"""Hooks pytest-kvprofile adds for engines and backend repositories (registered by the plugin)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

    from pytest_kvprofile.checks.base import JsonObject
    from pytest_kvprofile.registry import Registry


def pytest_kvprofile_backends(config: pytest.Config) -> object:
    """Return a Backend (or a list of them) to run the suite against; called once at configure.

    Implement it in a conftest.py to register a backend without packaging it.
    """


def pytest_kvprofile_update_json(config: pytest.Config, report: JsonObject) -> None:
    """Add fields to the JSON report and the verdict document before they are written (controller only)."""


def pytest_kvprofile_register(registry: Registry) -> None:
    """Make backends, checks and shared arena managers nameable in this run: ``registry.add_backends(*backends,
    group=None)``, ``registry.add_checks(*checks)`` (the suite makes a test of each, after the built-in ones),
    ``registry.add_workspace_manager(ManagerKind(...))``; an engine states its facts with
    ``registry.add_engine_facts(EngineFacts(...))`` (workspaces, KV-dtype names, route policy:
    ``matrix.engine_facts``). Called once at configure, in every process, before the backends are resolved. The
    package's own backends, checks, managers and engines register through it too."""

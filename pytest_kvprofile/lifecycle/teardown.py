"""A finished run's teardown: the parts' ``close()``, once, with what raises recorded in phase ``teardown``.
"""

from __future__ import annotations

import traceback

from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.phases import TEARDOWN
from pytest_kvprofile.lifecycle.record import (
    LifecycleResult,
    PhaseError,
)
from pytest_kvprofile.lifecycle.sites import _raised_at


def close_parts(result: LifecycleResult) -> None:
    """Let a finished run's parts drop their device memory (their optional ``close()``), once nothing more
    will be built on them: the record keeps what the checks read, and a session keeping recent records must
    not keep every case's workspaces (an engine's real builders hold hundreds of MiB each). Idempotent. A
    ``close()`` that raises is recorded in ``result.errors`` (phase ``teardown``), after every phase the checks
    read; memory it frees is marked freed in ``teardown`` (``LifecycleRun.close``)."""
    closer = result.closer
    if closer is not None:
        closer()
        return
    for part in result.builders:  # a record no run finished (built by hand): no device to close on
        close = getattr(part, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception as exc:  # noqa: BLE001
            result.errors.append(_teardown_error(builder_name(part), exc))



def _teardown_error(who: str, exc: BaseException) -> PhaseError:
    return PhaseError(
        phase=TEARDOWN, who=who, exc_type=type(exc).__name__, message=f"close() raised: {exc}",
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), site=_raised_at(exc),
    )


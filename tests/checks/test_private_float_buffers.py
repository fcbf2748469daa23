"""Float workspace a builder keeps for its wrappers instead of an arena view is a cost, not aliasing (issue 22.4):
``ubatch_arenas_disjoint`` accepts a wrapper bound into its own ``Role.FLOAT_WORKSPACE`` buffer, and refuses one such
buffer planned into by two micro-batches."""

from __future__ import annotations

from typing import Any

from pytest_kvprofile import Backend, Role
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASES = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None and c.envelope.num_ubatches > 1]
CHECK = CHECKS_BY_NAME["ubatch_arenas_disjoint"]


class OwnFloatBuffers(FlashInferLikeBuilder):
    """Each wrapper plans into a float workspace of its own, sized as the arena would be."""

    def __init__(self, case: Any):
        super().__init__(case)
        self.private: dict[tuple[str, int], Any] = {}

    def _buffer(self, ctx: Any, route: str, ubatch: int) -> Any:
        return ctx.allocate(self.float_bytes(), f"{route} own float workspace [ubatch {ubatch}]",
                            role=Role.FLOAT_WORKSPACE)

    def _new_wrapper(self, ctx: Any, route: str, ubatch: int) -> Any:
        w = super()._new_wrapper(ctx, route, ubatch)
        buf = self.private.get((route, ubatch)) or self._buffer(ctx, route, ubatch)
        self.private[(route, ubatch)] = buf
        w.float_ptr, w.float_bytes = buf.ptr, buf.nbytes
        return w


class SharedOwnFloatBuffer(OwnFloatBuffers):
    """The bug: micro-batch 1's wrappers plan into micro-batch 0's own buffer."""

    def _buffer(self, ctx: Any, route: str, ubatch: int) -> Any:
        return self.private.get((route, 0)) or super()._buffer(ctx, route, 0)


def _violations(cls: type, case: Any) -> list[str]:
    result = run_lifecycle(Backend(name=cls.__name__, make_builders=lambda c: [cls(c)]), case)
    close_parts(result)
    return CHECK.run(result)


def test_own_float_buffers_per_micro_batch_are_not_aliasing():
    for case in CASES[:4]:
        assert _violations(OwnFloatBuffers, case) == [], case.id


def test_one_own_buffer_for_two_micro_batches_is_refused():
    for case in CASES[:4]:
        found = _violations(SharedOwnFloatBuffer, case)
        assert any("own float workspace" in v and "micro-batches [0, 1]" in v for v in found), (case.id, found)

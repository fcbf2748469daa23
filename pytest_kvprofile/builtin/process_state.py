"""Builders that keep one trtllm-gen-like workspace per process, as the open vLLM pull request does.

The first engine of a process makes the workspace inside its profiling window (in
``reserve_persistent_workspace``) and every later engine in the process reuses it. That is correct: the harness
judges each case as the first engine of a fresh process (``lifecycle/module_state.py``). The same workspace may
live in any place process-wide state lives: a module dict, a closure, a ``functools`` cache (bounded or not), an
attribute of a class made with ``type()``, a ``threading.local``. ``place_backends()`` gives, per place, the
correct builder and its two buggy twins, made after KV sizing (in ``build``) and made anew by every engine; the
mutant catalog (``builtin/mutants.py``) carries the module-dict twins in ctx and torch mode.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import TYPE_CHECKING, Any, Callable

from pytest_kvprofile.builtin.stubs import (
    MODULE_GLOBAL_BYTES,
    FlashInferLikeBuilder,
    TorchFlashInferLikeBuilder,
)
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.contract.roles import Role

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.matrix.cases import Case

TRTLLM_KEY = "trtllm-gen"
ONCE, AFTER_KV, PER_ENGINE = "once", "after-kv", "per-engine"  # when a builder makes the process's workspace
AT_INIT = "at-init"  # once per process, by the first engine's constructor (vLLM's multi-CTA KV counter buffer)

_WORKSPACES: dict[str, Tensor] = {}  # the module dict: one trtllm-gen workspace per process (torch mode)
_ALLOCATIONS: dict[str, Allocation] = {}  # the same, as ledger allocations (ctx mode)
_ENGINES = itertools.count()  # the key a buggy builder caches its own workspace under, one per engine


def _new_workspace() -> Tensor:
    import torch

    return torch.zeros(MODULE_GLOBAL_BYTES, dtype=torch.uint8, device="cuda")


def _closure_place() -> tuple[Callable[[], Tensor | None], Callable[[Tensor], None]]:
    held: Tensor | None = None

    def get() -> Tensor | None:
        return held

    def put(value: Tensor) -> None:
        nonlocal held
        held = value

    return get, put


_closure_get, _closure_put = _closure_place()
_TLS = threading.local()
# Any: a class made at run time with type(), whose workspace attribute mypy cannot see
_HOLDERS: dict[str, Any] = {TRTLLM_KEY: type("TrtllmHolder", (), {"workspace": None})}


@functools.cache
def _cached_workspace(key: object) -> Tensor:
    return _new_workspace()


@functools.lru_cache(maxsize=4)
def _bounded_cached_workspace(key: object) -> Tensor:
    return _new_workspace()


class _Place:
    """Where a builder keeps the process's workspace: ``get`` answers None until ``make`` put one there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self) -> Any:  # Any: a Tensor or None; the type()-made class's attribute is untyped
        if self.name == "module-dict":
            return _WORKSPACES.get(TRTLLM_KEY)
        if self.name == "closure":
            return _closure_get()
        if self.name == "type-class":
            return _HOLDERS[TRTLLM_KEY].workspace
        if self.name == "thread-local":
            return getattr(_TLS, "workspace", None)
        return None  # a cache answers only when called: ``make`` finds what it holds

    def make(self, key: object) -> Tensor:
        """The workspace under ``key`` (a new one unless the place holds it)."""
        if self.name == "lru-cache":
            return _cached_workspace(key)
        if self.name == "bounded-lru-cache":
            return _bounded_cached_workspace(key)
        workspace = _new_workspace()
        if self.name == "module-dict":
            _WORKSPACES[TRTLLM_KEY] = workspace
        elif self.name == "closure":
            _closure_put(workspace)
        elif self.name == "type-class":
            _HOLDERS[TRTLLM_KEY].workspace = workspace
        else:
            _TLS.workspace = workspace
        return workspace


PLACES = ("module-dict", "closure", "lru-cache", "bounded-lru-cache", "type-class", "thread-local")


class TorchProcessWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """REQUIRED, torch mode: the trtllm-gen workspace is made by the process's first engine inside its window
    and reused by every later one (``when``/``place`` make its buggy twins)."""

    place = _Place("module-dict")
    when = ONCE

    def __init__(self, case: Case):
        super().__init__(case)
        self.trtllm: Tensor | None = None  # the wrappers' reference to the process's workspace
        if self.when == AT_INIT:  # before the profiling window: KV sizing counts it as the model's
            self.trtllm = self._workspace()

    def _workspace(self) -> Tensor:
        if self.when == PER_ENGINE:
            return self.place.make(next(_ENGINES))  # the bug: a new one for every engine
        found = self.place.get()
        return found if found is not None else self.place.make(TRTLLM_KEY)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        if self.when in (ONCE, PER_ENGINE):
            self.trtllm = self._workspace()
        return super().reserve_persistent_workspace(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if self.trtllm is None:  # the bug of AFTER_KV: made on the first real plan, after KV sizing
            self.trtllm = self._workspace()
        self.trtllm[:64].zero_()  # the trtllm-gen kernels use it


class ProcessWorkspaceBuilder(FlashInferLikeBuilder):
    """REQUIRED, ctx mode: the trtllm-gen workspace (``Role.TRTLLM_WORKSPACE``) kept in a module dict, made by the
    process's first engine inside its window and reused by every later one."""

    when = ONCE

    def __init__(self, case: Case):
        super().__init__(case)
        self.trtllm: Allocation | None = None

    def _workspace(self, ctx: BuilderContext) -> Allocation:
        found = _ALLOCATIONS.get(TRTLLM_KEY)
        if found is None or self.when == PER_ENGINE:
            found = _ALLOCATIONS[TRTLLM_KEY] = ctx.allocate(MODULE_GLOBAL_BYTES, "trtllm-gen workspace",
                                                           role=Role.TRTLLM_WORKSPACE)
        return found

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        if self.when != AFTER_KV:
            self.trtllm = self._workspace(ctx)
        return super().reserve_persistent_workspace(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if self.trtllm is None:
            self.trtllm = self._workspace(ctx)


def variant(base: type, when: str, place: str | None = None) -> type:
    """``base`` making the process's workspace ``when`` (and, torch mode, keeping it in ``place``)."""
    attrs: dict[str, object] = {"when": when,
                             "__doc__": f"{base.__doc__} Variant: {when}, kept in {place or 'module-dict'}."}
    if place is not None:
        attrs["place"] = _Place(place)
    suffix = "".join(p.title() for p in f"{place or ''}-{when}".replace("-", " ").split())
    return type(f"{base.__name__}{suffix}", (base,), attrs)


def _backend(name: str, cls: type, description: str) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case)], description=description, origin="builtin",
                   torch_mode=bool(getattr(cls, "torch_mode", False)))


def backends() -> list[Backend]:
    """The correct process-wide-workspace backends
    (``--kvprofile-backend pytest_kvprofile.builtin.process_state:backends``)."""
    return [
        _backend("stub-flashinfer-process-workspace", ProcessWorkspaceBuilder,
                 "one trtllm-gen workspace per process in a module dict, made in the first engine's window (ctx mode)"),
        _backend("stub-flashinfer-torch-process-workspace", TorchProcessWorkspaceBuilder,
                 "one trtllm-gen workspace per process in a module dict, made in the first engine's window "
                 "(torch mode)"),
        _backend("stub-flashinfer-torch-process-counter", variant(TorchProcessWorkspaceBuilder, AT_INIT),
                 "one buffer per process in a module dict, made by the first engine's constructor (torch mode)"),
    ]


def place_backends() -> list[Backend]:
    """Per place process-wide state lives in, the correct torch-mode builder and its two buggy twins
    (``--kvprofile-backend pytest_kvprofile.builtin.process_state:place_backends``)."""
    return [
        _backend(f"process-workspace-{place}-{when}", variant(TorchProcessWorkspaceBuilder, when, place),
                 f"the trtllm-gen workspace kept in a {place}, made {when}")
        for place in PLACES for when in (ONCE, AFTER_KV, PER_ENGINE)
    ]

"""The pull request's own vLLM modules, loaded from a private copy in place of the installed ones.

The pull request's code is not in this repository. ``KVPROFILE_PR_DIR`` names a directory laid out as vLLM's tree
(``vllm/v1/attention/backends/flashinfer.py``, optionally ``vllm/v1/attention/backend.py`` and
``vllm/v1/worker/workspace.py``); ``KVPROFILE_PR_DIRS`` names several, separated by ``os.pathsep`` (one per
revision). :func:`pull_request_modules` loads each file found under its vLLM module name in ``sys.modules``, so the
built-in ``vllm-flashinfer`` backend drives it, and restores the installed modules on exit. The venv is not touched.

The pull request sits on a newer vLLM than the installed release. Names its files import that the release lacks
are bridged, each listed in :data:`BRIDGES` with why (a module the release renamed is made for the block).
A name missing and not bridged fails the load naming it.

As a pytest plugin (``-p pr_overlay`` with ``tests/engines`` on ``PYTHONPATH``), the first copy named is loaded for
the whole run, before the suite's configure, so ``--kvprofile --kvprofile-backend vllm-flashinfer`` judges it on
any matrix (docs/vllm.md, "Driving the pull request's own code").
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest

# module -> file, in load order (the backend base before the FlashInfer module that imports it)
FILES = (
    ("vllm.v1.worker.workspace", "vllm/v1/worker/workspace.py"),
    ("vllm.v1.attention.backend", "vllm/v1/attention/backend.py"),
    ("vllm.v1.attention.backends.flashinfer", "vllm/v1/attention/backends/flashinfer.py"),
)


def _quantized_from_kv_cache_interface() -> Any:  # Any: vLLM's function, untyped here
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    return is_quantized_kv_cache


def _split_views_unavailable() -> Any:  # Any: a stand-in callable
    def nvfp4_kv_cache_split_views(*args: object, **kwargs: object) -> Any:
        raise NotImplementedError("nvfp4_kv_cache_split_views is not in the installed vLLM (the pull request's "
                                  "base adds it); only a mixed-head NVFP4 forward calls it")

    return nvfp4_kv_cache_split_views


def _tri_state_enum() -> Any:  # Any: an enum class
    from pytest_kvprofile.engines.vllm.pull_request import PersistentWorkspaceProfilingSupport

    return PersistentWorkspaceProfilingSupport


def _layout_type() -> Any:  # Any: a typing alias
    from typing import Literal

    return Literal["NHD", "HND"]


def _layout_from_config() -> Any:  # Any: a stand-in callable
    def get_kv_cache_layout() -> str:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

        config = get_current_vllm_config_or_none()
        if config is None or getattr(config.cache_config, "kv_cache_layout", None) is None:
            return "NHD"  # the older base's default
        return str(get_flashinfer_layout_string(config.cache_config.get_resolved_kv_cache_layout()))

    return get_kv_cache_layout


def _from_dcp(name: str) -> Callable[[], Any]:
    def make() -> Any:  # Any: vLLM's function
        import vllm.v1.attention.ops.dcp as dcp

        return getattr(dcp, name)

    return make


def _seq_lens_cpu() -> Any:  # Any: a property
    return property(lambda self: self.seq_lens.cpu())


# (module, name, why, make): a name the pull request's files import that the installed vLLM lacks
BRIDGES: tuple[tuple[str, str, str, Callable[[], Any]], ...] = (
    ("vllm.utils.torch_utils", "is_quantized_kv_cache",
     "moved there from vllm.v1.kv_cache_interface on the pull request's base; the same function",
     _quantized_from_kv_cache_interface),
    ("vllm.utils.torch_utils", "nvfp4_kv_cache_split_views",
     "new on the pull request's base; called only by a mixed-head NVFP4 forward, which no check runs",
     _split_views_unavailable),
    ("vllm.v1.attention.backend", "PersistentWorkspaceProfilingSupport",
     "defined by the pull request's backend.py; when no copy of it is given, the enum with its values "
     "(UNSUPPORTED 0, NEUTRAL 1, REQUIRED 2) from engines/vllm/pull_request.py", _tri_state_enum),
    # the 7a3177c revision sits on a base older than 0.33 for these
    ("vllm.v1.attention.backends.utils", "KVCacheLayoutType",
     "the older base's Literal['NHD', 'HND']; 0.33 has the KVCacheLayout enum", _layout_type),
    ("vllm.v1.attention.backends.utils", "get_kv_cache_layout",
     "the older base's resolver; here the layout 0.33 resolved into cache_config, in FlashInfer's names",
     _layout_from_config),
    ("vllm.v1.attention.ops.common", "cp_lse_ag_out_rs", "moved to vllm.v1.attention.ops.dcp in 0.33",
     _from_dcp("cp_lse_ag_out_rs")),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata.seq_lens_cpu",
     "the older base's field; 0.33 dropped it (its seq_lens.cpu() is the same values)", _seq_lens_cpu),
    ("vllm.v1.attention.ops.dcp_alltoall", "dcp_a2a_lse_reduce",
     "the module became vllm.v1.attention.ops.dcp in 0.33", _from_dcp("dcp_a2a_lse_reduce")),
)


def private_dirs() -> list[Path]:
    """The private copies named by the environment (none when unset)."""
    named = [os.environ.get("KVPROFILE_PR_DIR", "")] + os.environ.get("KVPROFILE_PR_DIRS", "").split(os.pathsep)
    return [Path(p) for p in named if p and (Path(p) / FILES[2][1]).is_file()]


def revision_of(root: Path) -> str:
    """The directory's name: by convention the commit the copy was read at."""
    return root.name


@contextlib.contextmanager
def pull_request_modules(root: Path) -> Iterator[dict[str, ModuleType]]:
    """The files under ``root`` loaded as vLLM's modules for the block; yields {module name: module loaded}."""
    import importlib

    from pytest_kvprofile.engines.vllm.standins import import_vllm_flashinfer

    import_vllm_flashinfer()  # the installed release imported first, with the stand-in platform current
    saved_modules: dict[str, ModuleType | None] = {}
    saved_attrs: list[tuple[Any, str, object]] = []  # Any: a module or a class
    _absent = object()
    loaded: dict[str, ModuleType] = {}
    try:
        for name, rel in FILES:
            path = root / rel
            if not path.is_file():
                continue
            saved_modules[name] = sys.modules.get(name)
            if name == FILES[2][0]:
                for mod_name, attr, _why, make in BRIDGES:
                    try:
                        module = importlib.import_module(mod_name)
                    except ModuleNotFoundError:  # a module the release renamed: made for the block
                        module = ModuleType(mod_name)
                        saved_modules.setdefault(mod_name, None)
                        sys.modules[mod_name] = module
                    owner: Any = module  # Any: a module, or a class of it for "Class.attr"
                    if "." in attr:
                        cls_name, attr = attr.split(".")
                        owner = getattr(module, cls_name)
                    if attr not in dir(owner):
                        saved_attrs.append((owner, attr, _absent))
                        setattr(owner, attr, make())
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            parent, _, leaf = name.rpartition(".")
            saved_attrs.append((sys.modules[parent], leaf, getattr(sys.modules[parent], leaf, _absent)))
            setattr(sys.modules[parent], leaf, module)
            loaded[name] = module
        yield loaded
    finally:
        for module, attr, value in reversed(saved_attrs):
            if value is _absent:
                delattr(module, attr)
            else:
                setattr(module, attr, value)
        for name, previous in saved_modules.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


_RUN: list[contextlib.ExitStack] = []  # the run's overlay, when this module is loaded as a plugin
_LOADED = pytest.StashKey[str]()  # what it loaded, for the report header


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Loaded with ``-p pr_overlay``: the first private copy named replaces vLLM's modules until the run ends."""
    roots = private_dirs()
    if not roots:
        raise pytest.UsageError("-p pr_overlay: KVPROFILE_PR_DIR / KVPROFILE_PR_DIRS name no private copy of the pull "
                                "request's vllm/v1/attention/backends/flashinfer.py")
    stack = contextlib.ExitStack()
    loaded = stack.enter_context(pull_request_modules(roots[0]))
    _RUN.append(stack)
    config.stash[_LOADED] = f"{revision_of(roots[0])}: {', '.join(sorted(loaded))}"


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"pull request overlay: {config.stash[_LOADED]}" if _LOADED in config.stash else None


def pytest_unconfigure(config: pytest.Config) -> None:
    while _RUN:
        _RUN.pop().close()


"""What differs between the vLLM releases a user may have, read from the installed wheel (never from a version list).

| vLLM | model runners | KV sizing by default | FlashInfer pinned |
|---|---|---|---|
| 0.30 to 0.33 | V1 and V2 | the profiling window (``memory_profiling``, a graph estimate) | 0.6.18 to 0.7.2.post1 |
| 0.34 | V2 only | the extensible KV cache: measured after kernel warmup and graph capture | 0.7.3 |

Each fact is asked of the installed vLLM by what it has (a module, a config field), so a release between or after
these is judged by what it ships. Nothing here imports vLLM at module import.
"""

from __future__ import annotations

import functools
import importlib.util
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.contract.backends import Provenance

if TYPE_CHECKING:

    from pytest_kvprofile.matrix.cases import Case

__all__ = ["EXTENSIBLE", "PROFILE_WINDOW", "extensible_kv_cache_request", "has_v1_runner", "has_extensible_kv_cache",
           "provenance", "runner_name", "vllm_provenance", "vllm_version"]

EXTENSIBLE = "extensible KV cache (after warmup and capture)"
PROFILE_WINDOW = "profile window"
_V1_RUNNER = "v1/worker/gpu_model_runner.py"
# vLLM's own pins, for the verdict's note beside the FlashInfer that ran (its metadata says the same)
_PINS_FLASHINFER = "flashinfer-python"


def vllm_version() -> str:
    """The installed vLLM's version, from its metadata (vLLM is not imported); empty when it is not installed."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=1)
def has_v1_runner() -> bool:
    """Whether the installed vLLM still ships the V1 model runner (0.34 removed ``gpu_model_runner.py``); read from the
    installed files, so asking imports nothing of vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / _V1_RUNNER).is_file() for p in spec.submodule_search_locations)


def runner_name(v2: bool) -> str:
    """The runner a backend drives: V1 only where the installed vLLM has it and the backend asks for it."""
    return "V1" if not v2 and has_v1_runner() else "V2"


@functools.lru_cache(maxsize=1)
def has_extensible_kv_cache() -> bool:
    """Whether the installed vLLM has the extensible KV cache (``CacheConfig.enable_extensible_kv_cache``)."""
    from vllm.config import CacheConfig

    return "enable_extensible_kv_cache" in getattr(CacheConfig, "__dataclass_fields__", {})


def extensible_kv_cache_request(case: Case) -> dict[str, bool]:
    """The ``CacheConfig`` arguments of the case's KV sizing request (``envelope.kv_sizing``): ``profile`` asks a vLLM
    that has the extensible KV cache to turn it off; ``engine`` leaves vLLM's own resolution alone."""
    if case.envelope.kv_sizing == "profile" and has_extensible_kv_cache():
        return {"enable_extensible_kv_cache": False}
    return {}


def pinned_flashinfer() -> str:
    """The FlashInfer requirement the installed vLLM declares (``flashinfer-python==0.7.3``), or empty."""
    try:
        requires = metadata.requires("vllm") or []
    except metadata.PackageNotFoundError:
        return ""
    for req in requires:
        if req.replace("_", "-").startswith(_PINS_FLASHINFER) and "extra ==" not in req:
            return req.split(";")[0].strip()
    return ""


def vllm_provenance(backend_name: str) -> Callable[[], Provenance]:
    """``Backend.provenance`` of a vLLM backend: the installed vLLM and the runner it drives (``-v2`` backends ask for
    the V2 runner; the others for V1, which is V2 where the installed vLLM has no V1)."""
    return functools.partial(provenance, v2=backend_name.endswith("-v2"))


def provenance(v2: bool) -> Provenance:
    """What the verdict names about the vLLM a backend ran on (no vLLM import)."""
    pin = pinned_flashinfer()
    notes = (f"vLLM pins {pin}",) if pin else ()
    return Provenance(engine="vllm", engine_version=vllm_version(), runner=runner_name(v2), notes=notes)

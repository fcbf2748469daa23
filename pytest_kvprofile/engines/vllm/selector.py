"""vLLM's attention selector, asked of the backend class actually driven: does it accept the case's layout?

Why: vLLM picks an attention backend by asking the backend class (``AttentionBackend.validate_configuration``: head
size, dtype, KV-cache dtype, block size, compute capability, ...) and refuses the configuration when the class says
no. A builder class carrying its own revision of the backend (the open pull request's ``flashinfer.py`` overlaid on a
released vLLM, whose ``FlashInferBackend.supports_kv_cache_dtype`` refuses NVFP4 off SM100) must be refused where that
class refuses, not where the installed release's class would. The answer comes from the class's own code, on the
stand-in platform of the case's GPU (call it inside ``vllm_standins``).
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["backend_class_of", "selector_refusal", "selector_values"]

# the predicates vLLM's validate_configuration asks, for a backend class without it: (method, value name, reason)
_PREDICATES = (
    ("supports_head_size", "head_size", "head_size not supported"),
    ("supports_dtype", "dtype", "dtype not supported"),
    ("supports_kv_cache_dtype", "kv_cache_dtype", "kv_cache_dtype not supported"),
    ("supports_block_size", "block_size", "block_size not supported"),
    ("supports_compute_capability", "device_capability", "compute capability not supported"),
)


# Any: vLLM's AttentionBackend subclass; this module imports no vLLM at import
def backend_class_of(builder_cls: type) -> Any:
    """The attention backend class whose ``get_builder_cls()`` is ``builder_cls`` (or one of its bases): searched in
    the builder class's own module first, then in its bases' modules. None when no module has one."""
    modules = [sys.modules.get(c.__module__) for c in builder_cls.__mro__]
    found: list[tuple[int, Any]] = []  # Any: vLLM attention backend classes, by priority
    for module in dict.fromkeys(m for m in modules if m is not None):
        for value in vars(module).values():
            get = getattr(value, "get_builder_cls", None) if isinstance(value, type) else None
            if not callable(get) or inspect.isabstract(value):
                continue
            try:
                made = get()
            except Exception:  # noqa: BLE001 - an abstract or broken backend class builds nothing here
                continue
            if isinstance(made, type) and made in builder_cls.__mro__:
                found.append((builder_cls.__mro__.index(made), value))
    return min(found, key=lambda f: f[0])[1] if found else None


def selector_values(case: Case) -> dict[str, Any]:  # Any: the values vLLM's selector passes, by name
    """What vLLM's selector asks a backend class about ``case`` (``AttentionSelectorConfig``'s fields and the device
    capability), by name: a decoder's full causal attention, no MLA, sinks, sparsity or sliding window."""
    import torch
    from vllm.platforms.interface import DeviceCapability

    from pytest_kvprofile.engines.vllm.config import cache_dtype, model_dtype

    major, minor = case.gpu.compute_capability
    return {
        "head_size": case.model.head_dim, "dtype": getattr(torch, model_dtype(case)),
        "kv_cache_dtype": cache_dtype(case), "block_size": case.envelope.page_size, "use_mla": False,
        "has_sink": False, "use_sparse": False, "use_mm_prefix": False, "use_per_head_quant_scales": False,
        "device_capability": DeviceCapability(major, minor), "attn_type": "decoder", "has_sliding_window": False,
        "use_non_causal": False, "use_batch_invariant": False, "use_kv_connector": False, "use_pcp": False,
        "use_adaptive_verification": False, "use_dcp": case.dcp > 1, "use_rswa": False,
    }


def _ask(backend_cls: Any, values: dict[str, Any]) -> list[str]:  # Any: a vLLM backend class
    """The class's invalid reasons: its ``validate_configuration`` called by its own parameter names where every
    parameter without a default is one the selector fills; otherwise each predicate the class has."""
    validate = getattr(backend_cls, "validate_configuration", None)
    if callable(validate):
        params = inspect.signature(validate).parameters.values()
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if all(p.name in values or p.default is not p.empty for p in named):
            return [str(r) for r in validate(**{p.name: values[p.name] for p in named if p.name in values})]
    reasons = []
    for method, name, reason in _PREDICATES:
        ask = getattr(backend_cls, method, None)
        if callable(ask) and not ask(values[name]):
            reasons.append(reason)
    return reasons


def selector_refusal(case: Case, backend_cls: Any) -> str | None:  # Any: a vLLM backend class
    """Why vLLM's selector refuses ``backend_cls`` on ``case`` (the class's own reasons, then what it was asked), or
    None when it accepts it or there is no class to ask."""
    if backend_cls is None:
        return None
    values = selector_values(case)
    reasons = _ask(backend_cls, values)
    if not reasons:
        return None
    cc = values["device_capability"]
    return (f"case {case.id}: vLLM's attention selector refuses {backend_cls.__module__}.{backend_cls.__qualname__} "
            f"for this layout: {'; '.join(reasons)} (kv_cache_dtype {values['kv_cache_dtype']!r}, head_size "
            f"{values['head_size']}, block_size {values['block_size']}, {values['dtype']}, SM{cc.major}{cc.minor} "
            f"{case.gpu.name}); the backend class of the builder driven decides, as vLLM asks it")

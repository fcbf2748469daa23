"""Checks for one value of a matrix file: types, ranges, models, GPUs, the envelope and the KV dtypes.

Each check raises :class:`MatrixError` naming the file and the key. ``matrix/axes.py`` and ``matrix/schema.py``
call them; nothing here expands cases.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

from pytest_kvprofile.matrix.cases import KV_SIZING_REQUESTS, Envelope
from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu
from pytest_kvprofile.matrix.kv_dtypes import KV_DTYPES
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.units import GB, GiB

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import YamlValue

MAX_NUMBER = 2**53


class MatrixError(ValueError):
    """A matrix file is malformed; the message names the file and the key."""

    def __init__(self, path: str, key: str, message: str):
        self.path, self.key = path, key
        super().__init__(f"{path}: {key}: {message}")


_MODEL_KEYS: dict[str, type | tuple[type, ...]] = {
    "heads_q": int,
    "heads_kv": int,
    "head_dim": int,
    "head_dim_vo": int,
    "num_layers": int,
    "kv_dtype": (str, list),  # a list is an axis: the model's cases expand over it, their ids gain "-kv<dtype>"
    "attention": str,
    "kv_cache_heads": int,
    "kv_cache_head_dim": int,
    "weights_gib": (int, float),
    "hidden_size": int,
    "full_attention_interval": int,
    "linear_heads_k": int,
    "linear_heads_v": int,
    "linear_head_dim": int,
    "linear_conv_kernel": int,
}
_HYBRID_KEYS = ("linear_heads_k", "linear_heads_v", "linear_head_dim")
_MODEL_REQUIRED = ("heads_q", "heads_kv", "head_dim", "num_layers")
_GPU_KEYS: dict[str, type | tuple[type, ...]] = {"name": str, "num_sm": int, "memory_gib": (int, float),
                                                 "memory_gb": (int, float), "interconnect": str}
_ENVELOPE_KEYS: dict[str, type | tuple[type, ...]] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "page_size": int,
    "cuda_graph_sizes": list,
    "num_ubatches": (int, list),  # a list is an axis: cases expand over it, their ids gain "-ub<N>"
    "nontorch_mib": int,
    "kv_sizing": str,  # KV_SIZING_REQUESTS: the engine's default sizing point, or its profiling window asked for
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(path: str, key: str, value: object, expected: type | tuple[type, ...]) -> None:
    types = expected if isinstance(expected, tuple) else (expected,)
    ok = any((_is_int(value) if t is int else isinstance(value, t) and not isinstance(value, bool)) for t in types)
    if not ok:
        names = " or ".join("integer" if t is int else t.__name__ for t in types)
        raise MatrixError(path, key, f"expected {names}, got {value!r}")
    _in_range(path, key, value)


def _in_range(path: str, key: str, value: object) -> None:
    """Numbers beyond 2**53 only come from typos; past it, byte arithmetic overflows floats."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise MatrixError(path, key, f"{value!r} is out of range (at most {MAX_NUMBER})")


def _mapping(path: str, key: str, value: object) -> dict[str, YamlValue]:
    if not isinstance(value, dict):
        raise MatrixError(path, key, f"expected a mapping, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise MatrixError(path, f"{key}.{k!r}", "keys must be strings")
    return value


def _unknown(path: str, where: str, keys: Iterable[str], allowed: Iterable[str]) -> None:
    for k in keys:
        if k not in allowed:
            choices = ", ".join(sorted(allowed))
            raise MatrixError(path, f"{where}{k}" if k else f"{where}<empty key>", f"unknown key (allowed: {choices})")


def _int_list(path: str, key: str, value: object, minimum: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise MatrixError(path, key, f"expected a non-empty list of integers, got {value!r}")
    for i, item in enumerate(value):
        if not _is_int(item) or item < minimum:
            raise MatrixError(path, f"{key}[{i}]", f"expected an integer >= {minimum}, got {item!r}")
        _in_range(path, f"{key}[{i}]", item)
    if len(set(value)) != len(value):
        raise MatrixError(path, key, f"duplicate values in {value!r}")
    return list(value)


def _positive(path: str, key: str, value: float) -> None:
    if value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise MatrixError(path, key, f"must be positive, got {value!r}")


def _parse_model(path: str, name: str, raw: object) -> ModelSpec:
    where = f"models.{name}"
    raw = _mapping(path, where, raw)
    _unknown(path, f"{where}.", raw, _MODEL_KEYS)
    for key in _MODEL_REQUIRED:
        if key not in raw:
            raise MatrixError(path, f"{where}.{key}", "missing required key")
    for key, value in raw.items():
        _check_type(path, f"{where}.{key}", value, _MODEL_KEYS[key])
        if key not in ("kv_dtype", "attention", "weights_gib"):
            _positive(path, f"{where}.{key}", value)
    if raw.get("weights_gib", 0) < 0 or not math.isfinite(raw.get("weights_gib", 0)):
        raise MatrixError(path, f"{where}.weights_gib", f"must be a finite number >= 0, got {raw['weights_gib']!r}")
    if "kv_dtype" in raw:
        raw = {**raw, "kv_dtype": kv_dtype_values(path, f"{where}.kv_dtype", raw["kv_dtype"])[0]}
    if raw.get("attention", "mha") not in ("mha", "mla"):
        raise MatrixError(path, f"{where}.attention", f"expected 'mha' or 'mla', got {raw['attention']!r}")
    if raw["heads_q"] % raw["heads_kv"]:
        raise MatrixError(
            path, f"{where}.heads_kv", f"{raw['heads_q']} query heads are not a multiple of {raw['heads_kv']} KV heads"
        )
    hybrid = [k for k in (*_HYBRID_KEYS, "linear_conv_kernel") if k in raw]
    if "full_attention_interval" in raw or hybrid:
        for key in ("full_attention_interval", *_HYBRID_KEYS):
            if key not in raw:
                raise MatrixError(path, f"{where}.{key}", "missing required key of a hybrid (GDN) model")
        if raw["full_attention_interval"] > raw["num_layers"]:
            raise MatrixError(path, f"{where}.full_attention_interval",
                              f"{raw['full_attention_interval']} exceeds num_layers {raw['num_layers']}")
        if raw.get("attention", "mha") != "mha":
            raise MatrixError(path, f"{where}.attention", "a hybrid (GDN) model's full-attention layers are 'mha'")
    return ModelSpec(name=name, **raw)


def _parse_gpu(path: str, index: int, raw: object) -> GpuSpec:
    where = f"gpus[{index}]"
    if isinstance(raw, str):
        try:
            return lookup_gpu(raw)
        except KeyError as exc:
            raise MatrixError(path, where, str(exc.args[0])) from None
    raw = _mapping(path, where, raw)
    _unknown(path, f"{where}.", raw, _GPU_KEYS)
    for key, value in raw.items():
        _check_type(path, f"{where}.{key}", value, _GPU_KEYS[key])
    if "name" not in raw:
        raise MatrixError(path, f"{where}.name", "missing required key")
    if "num_sm" not in raw and "memory_gib" not in raw and "memory_gb" not in raw:
        try:
            return lookup_gpu(raw["name"])
        except KeyError as exc:
            raise MatrixError(path, f"{where}.name", str(exc.args[0])) from None
    for key in ("num_sm",):
        if key not in raw:
            raise MatrixError(path, f"{where}.{key}", "missing required key for an inline GPU")
    _positive(path, f"{where}.num_sm", raw["num_sm"])
    if "memory_gib" in raw:
        _positive(path, f"{where}.memory_gib", raw["memory_gib"])
        memory = int(raw["memory_gib"] * GiB)
    elif "memory_gb" in raw:
        _positive(path, f"{where}.memory_gb", raw["memory_gb"])
        memory = int(raw["memory_gb"] * GB)
    else:
        raise MatrixError(path, f"{where}.memory_gib", "missing required key for an inline GPU")
    interconnect = raw.get("interconnect", "pcie")
    if interconnect not in ("pcie", "nvlink"):
        raise MatrixError(path, f"{where}.interconnect", f"expected 'pcie' or 'nvlink', got {interconnect!r}")
    return GpuSpec(raw["name"], raw["num_sm"], memory, interconnect)


def parse_envelope(path: str, raw: object) -> Envelope:
    """Validate an ``envelope:`` mapping; errors name ``path`` and the key."""
    raw = _mapping(path, "envelope", raw)
    _unknown(path, "envelope.", raw, _ENVELOPE_KEYS)
    values: dict[str, YamlValue] = {}
    for key, value in raw.items():
        _check_type(path, f"envelope.{key}", value, _ENVELOPE_KEYS[key])
        if key == "cuda_graph_sizes":  # tokens per captured step; [] turns CUDA graphs off
            sizes = _int_list(path, "envelope.cuda_graph_sizes", value, 1) if value else []
            values[key] = tuple(sorted(sizes))
        elif key == "num_ubatches" and isinstance(value, list):  # the axis (ubatch_axis); its first value here
            values[key] = _int_list(path, "envelope.num_ubatches", value, 1)[0]
        elif key == "kv_sizing":
            if value not in KV_SIZING_REQUESTS:
                raise MatrixError(path, "envelope.kv_sizing",
                                  f"is {value!r}; expected one of {', '.join(KV_SIZING_REQUESTS)}")
            values[key] = value
        else:
            _positive(path, f"envelope.{key}", value)
            values[key] = value
    env = Envelope(**values)
    if env.max_num_seqs > env.max_num_batched_tokens:
        raise MatrixError(path, "envelope.max_num_seqs", "exceeds max_num_batched_tokens")
    return env


def ubatch_axis(raw_envelope: object) -> list[int] | None:
    """The micro-batch counts a matrix lists as an axis (``envelope.num_ubatches: [1, 2]``), or None when it sets
    one count (``num_ubatches: 2``): then case ids carry no suffix. Call after :func:`parse_envelope`."""
    value = raw_envelope.get("num_ubatches") if isinstance(raw_envelope, dict) else None
    return list(value) if isinstance(value, list) else None


def ubatch_case_id(base: str, num_ubatches: int | None) -> str:
    """A case id with the micro-batch suffix when micro-batches are an axis of its matrix."""
    return base if num_ubatches is None else f"{base}-ub{num_ubatches}"


def _parse_gmu(path: str, value: object) -> list[float]:
    if not isinstance(value, list) or not value:
        raise MatrixError(path, "gmu", f"expected a non-empty list of numbers in (0, 1], got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 < item <= 1:
            raise MatrixError(path, f"gmu[{i}]", f"expected a number in (0, 1], got {item!r}")
        out.append(float(item))
    if len(set(out)) != len(out):
        raise MatrixError(path, "gmu", f"duplicate values in {value!r}")
    return out


def kv_dtype_values(path: str, key: str, value: object) -> list[str]:
    """A ``kv_dtype`` value (one name, or a non-empty list of distinct names), checked against the dtype table."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise MatrixError(path, key, "expected a KV dtype or a non-empty list of them")
    for i, item in enumerate(values):
        where = f"{key}[{i}]" if isinstance(value, list) else key
        if not isinstance(item, str) or item not in KV_DTYPES:
            raise MatrixError(path, where, f"unknown KV dtype {item!r} (known: {', '.join(KV_DTYPES)})")
    if len(set(values)) != len(values):
        raise MatrixError(path, key, f"duplicate values in {value!r}")
    return list(values)


def kv_dtype_axis(raw_model: object, top: object) -> list[str | None]:
    """The KV dtypes one model's cases expand over: the model's own ``kv_dtype`` list, else the file's; ``[None]``
    when neither lists several (a single value is the model's ``kv_dtype``, and the ids carry no suffix)."""
    if isinstance(raw_model, dict) and "kv_dtype" in raw_model:
        own = raw_model["kv_dtype"]
        return list(own) if isinstance(own, list) else [None]
    return list(top) if isinstance(top, list) else [None]


def kv_case_id(base: str, dtype: str | None) -> str:
    """A case id with the KV dtype suffix when KV dtypes are an axis for its model."""
    return base if dtype is None else f"{base}-kv{dtype}"



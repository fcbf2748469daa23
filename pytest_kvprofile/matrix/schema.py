"""Matrix files: YAML that names models, GPUs and parallel layouts, expanded into cases.

Expansion is deterministic (file order, then models x gpus x tp x dcp x mtp x gmu, x micro-batch counts when
``envelope.num_ubatches`` lists several: those ids end in ``-ub<N>``, x KV dtypes when ``kv_dtype`` is a list, per
model or for the whole file: those ids end in ``-kv<dtype>``; single values keep the ids unchanged), derives the
per-rank heads as docs/contract.md ("Parallel layouts") says, and keeps impossible combinations as cases that carry
a skip reason, so they show up in the id list instead of vanishing. Validation happens once, at
load; a bad file raises MatrixError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import yaml

from pytest_kvprofile.matrix.cases import KV_SIZING_REQUESTS, Case, Envelope, Matrix, Resource, case_id
from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu, slugify
from pytest_kvprofile.matrix.kv_dtypes import KV_DTYPES
from pytest_kvprofile.matrix.models import ModelSpec, impossible_layout
from pytest_kvprofile.units import GB, GiB

if TYPE_CHECKING:
    from typing import Hashable

    from pytest_kvprofile.matrix.cases import YamlValue

MAX_NUMBER = 2**53


class MatrixError(ValueError):
    """A matrix file is malformed; the message names the file and the key."""

    def __init__(self, path: str, key: str, message: str):
        self.path, self.key = path, key
        super().__init__(f"{path}: {key}: {message}")


_TOP_KEYS = {"name", "description", "envelope", "models", "gpus", "tp", "dcp", "mtp", "gmu", "kv_dtype", "exclude",
             "resources"}
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
_EXCLUDE_KEYS = {"model", "gpu", "tp", "dcp", "mtp", "gmu", "kv_dtype"}
_RESOURCE_KEYS = {"kind", "when", "params"}


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


def _parse_excludes(path: str, raw: object) -> list[dict[str, YamlValue]]:
    if not isinstance(raw, list):
        raise MatrixError(path, "exclude", f"expected a list of mappings, got {type(raw).__name__}")
    out = []
    for i, item in enumerate(raw):
        item = _mapping(path, f"exclude[{i}]", item)
        _unknown(path, f"exclude[{i}].", item, _EXCLUDE_KEYS)
        if not item:
            raise MatrixError(path, f"exclude[{i}]", "an empty exclusion would remove every case")
        _rule_values(path, f"exclude[{i}]", item)
        out.append(item)
    return out


_RULE_TYPES: dict[str, type | tuple[type, ...]] = {"model": str, "gpu": (str, int), "tp": int, "dcp": int, "mtp": int,
                                                   "gmu": (int, float), "kv_dtype": str, "interconnect": str,
                                                   "min_tp": int}


def _rule_values(path: str, where: str, rule: dict[str, YamlValue]) -> None:
    """An exclude/when value is a scalar of the axis's type or a non-empty list of them."""
    for key, want in rule.items():
        if key == "min_tp":
            _check_type(path, f"{where}.{key}", want, int)
            continue
        wants = want if isinstance(want, list) else [want]
        if not wants:
            raise MatrixError(path, f"{where}.{key}", "expected a value or a non-empty list of values")
        for w in wants:
            _check_type(path, f"{where}.{key}", w, _RULE_TYPES[key])


def _parse_resources(path: str, raw: object) -> list[tuple[dict[str, YamlValue], Resource]]:
    if not isinstance(raw, list):
        raise MatrixError(path, "resources", f"expected a list of mappings, got {type(raw).__name__}")
    out = []
    for i, item in enumerate(raw):
        where = f"resources[{i}]"
        item = _mapping(path, where, item)
        _unknown(path, f"{where}.", item, _RESOURCE_KEYS)
        if not isinstance(item.get("kind"), str) or not item["kind"]:
            raise MatrixError(path, f"{where}.kind", "missing or empty resource kind")
        when = _mapping(path, f"{where}.when", item.get("when", {}))
        _unknown(path, f"{where}.when.", when, _EXCLUDE_KEYS | {"interconnect", "min_tp"})
        _rule_values(path, f"{where}.when", when)
        params = _mapping(path, f"{where}.params", item.get("params", {}))
        out.append((when, Resource(item["kind"], tuple(sorted(params.items())))))
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


def _matches(rule: dict[str, YamlValue], model: str, gpu: GpuSpec, tp: int, dcp: int, mtp: int, gmu: float,
             kv: str = "bf16") -> bool:
    for key, want in rule.items():
        wants = want if isinstance(want, list) else [want]
        if key == "kv_dtype" and kv not in wants:
            return False
        if key == "model" and model not in wants:
            return False
        if key == "gpu" and gpu.slug not in [slugify(str(w)) for w in wants]:
            return False
        if key == "tp" and tp not in wants:
            return False
        if key == "dcp" and dcp not in wants:
            return False
        if key == "mtp" and mtp not in wants:
            return False
        if key == "gmu" and not any(abs(gmu - float(w)) < 1e-9 for w in wants):
            return False
        if key == "interconnect" and gpu.interconnect not in wants:
            return False
        if key == "min_tp" and tp < int(want):
            return False
    return True


FIT_MARGIN_GIB = 2


def kv_dtype_refusal(model: ModelSpec, gpu: GpuSpec) -> str | None:
    """Why ``model``'s KV dtype cannot be cached on ``gpu`` (NVFP4 needs SM80 or newer), or None."""
    need = model.kv.min_cc_major
    major = gpu.compute_capability[0]
    if need and major < need:
        have = f"sm_{major}{gpu.compute_capability[1]}" if major else "an unknown compute capability"
        return f"KV dtype {model.kv_dtype} needs compute capability {need}.x or newer; {gpu.name} has {have}"
    return None


def _weights_do_not_fit(model: ModelSpec, gpu: GpuSpec, tp: int, gmu: float, envelope: Envelope) -> bool:
    """A layout whose weights leave no room for activations and KV cannot be served at all."""
    need = model.weights_gib * GiB / tp + (envelope.nontorch_mib << 20) + FIT_MARGIN_GIB * GiB
    return need >= gpu.memory_bytes * gmu


def parse_matrix(data: object, path: str) -> Matrix:
    """Validate and expand an already-parsed YAML document."""
    data = _mapping(path, "<document>", data)
    _unknown(path, "", data, _TOP_KEYS)
    for key in ("models", "gpus", "tp"):
        if key not in data:
            raise MatrixError(path, key, "missing required key")
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str) or not name:
        raise MatrixError(path, "name", f"expected a non-empty string, got {name!r}")
    envelope = parse_envelope(path, data.get("envelope", {}))
    axis = ubatch_axis(data.get("envelope", {}))
    ubatches: list[int | None] = list(axis) if axis else [None]
    models_raw = _mapping(path, "models", data["models"])
    if not models_raw:
        raise MatrixError(path, "models", "no models")
    top_kv = kv_dtype_values(path, "kv_dtype", data["kv_dtype"]) if "kv_dtype" in data else None
    models = {mname: _parse_model(path, mname, mraw) for mname, mraw in models_raw.items()}
    if top_kv is not None:  # the file's dtype for models that name none
        models = {m: spec if "kv_dtype" in models_raw[m] else dataclasses.replace(spec, kv_dtype=top_kv[0])
                  for m, spec in models.items()}
    if not isinstance(data["gpus"], list) or not data["gpus"]:
        raise MatrixError(path, "gpus", f"expected a non-empty list, got {data['gpus']!r}")
    gpus = [_parse_gpu(path, i, g) for i, g in enumerate(data["gpus"])]
    slugs = [g.slug for g in gpus]
    if len(set(slugs)) != len(slugs):
        raise MatrixError(path, "gpus", f"duplicate GPUs in {slugs}")
    tps = _int_list(path, "tp", data["tp"], 1)
    dcps = _int_list(path, "dcp", data.get("dcp", [1]), 1)
    mtps = _int_list(path, "mtp", data.get("mtp", [0]), 0)
    gmus = _parse_gmu(path, data.get("gmu", [0.9]))
    excludes = _parse_excludes(path, data.get("exclude", []))
    resources = _parse_resources(path, data.get("resources", []))
    for i, rule in enumerate(excludes):
        if "model" in rule:
            for m in rule["model"] if isinstance(rule["model"], list) else [rule["model"]]:
                if m not in models:
                    raise MatrixError(path, f"exclude[{i}].model", f"unknown model {m!r}")

    matrix = Matrix(path=path, name=name, models=models)
    seen: set[str] = set()
    for mname, base_model in models.items():
        kvs = kv_dtype_axis(models_raw[mname], data.get("kv_dtype"))
        for gpu in gpus:
            for tp in tps:
                for dcp in dcps:
                    for mtp in mtps:
                        for gmu, ub, kv in itertools.product(gmus, ubatches, kvs):
                            model = base_model if kv is None else dataclasses.replace(base_model, kv_dtype=kv)
                            if any(_matches(rule, mname, gpu, tp, dcp, mtp, gmu, model.kv_dtype) for rule in excludes):
                                continue
                            cid = kv_case_id(ubatch_case_id(case_id(mname, tp, dcp, mtp, gpu, gmu), ub), kv)
                            if cid in seen:
                                raise MatrixError(path, f"models.{mname}", f"case id {cid!r} is generated twice")
                            seen.add(cid)
                            env = envelope if ub is None else dataclasses.replace(envelope, num_ubatches=ub)
                            reason = impossible_layout(model, tp, dcp, mtp) or kv_dtype_refusal(model, gpu)
                            if reason is None and _weights_do_not_fit(model, gpu, tp, gmu, env):
                                reason = (
                                    f"{model.name} weights ({model.weights_gib:g} GiB / tp={tp}) plus "
                                    f"{FIT_MARGIN_GIB} GiB of runtime headroom do not fit in "
                                    f"{gpu.name} memory at gmu {gmu:.2f}"
                                )
                            carried = tuple(
                                res for when, res in resources
                                if _matches(when, mname, gpu, tp, dcp, mtp, gmu, model.kv_dtype)
                            )
                            matrix.cases.append(
                                Case(
                                    id=cid, matrix=name, model=model, gpu=gpu, tp=tp, dcp=dcp, mtp=mtp, gmu=gmu,
                                    envelope=env, skip_reason=reason, resources=carried,
                                )
                            )
    return matrix


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader (no Python object tags) that also rejects duplicate keys."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, YamlValue]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}",
                                                    key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    mapping: dict[Hashable, YamlValue] = yaml.SafeLoader.construct_mapping(loader, node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_matrix_text(text: str, path: str) -> Matrix:
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "<document>"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise MatrixError(path, where, f"invalid YAML: {problem}") from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise MatrixError(path, "<document>", f"invalid YAML: {exc}") from None
    return parse_matrix(data, path)


def load_matrix(path: str | Path) -> Matrix:
    """Read, validate and expand one matrix file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(str(path), "<file>", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise MatrixError(str(path), "<file>", f"not UTF-8 text: {exc.reason}") from None
    return load_matrix_text(text, str(path))


def packaged_matrix(name: str) -> Path:
    """Path of a matrix shipped with the package (``ci``, ``default``, ``blackwell``, ``l40s``)."""
    return Path(__file__).resolve().parent.parent / "matrices" / f"{name}.yaml"


def load_matrices(paths: Iterable[str | Path]) -> list[Matrix]:
    """Load several matrices; case ids must stay unique across them."""
    out: list[Matrix] = []
    seen: dict[str, tuple[str, Case]] = {}
    for path in paths:
        matrix = load_matrix(path)
        kept = []
        for case in matrix.cases:
            if case.id in seen:
                first_path, first = seen[case.id]
                if first.layout_key[1:] != case.layout_key[1:] or first.gmu != case.gmu:
                    raise MatrixError(
                        str(path), "<cases>", f"case id {case.id!r} is also generated, differently, by {first_path}"
                    )
                continue
            seen[case.id] = (str(path), case)
            kept.append(case)
        matrix.cases = kept
        out.append(matrix)
    return out

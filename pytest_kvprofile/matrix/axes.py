"""The axes of a matrix, one record each: key, type, expansion, id suffix and how a rule matches it.

``matrix/schema.py`` loops over :data:`AXES` to check a file, expand its cases, build their ids and apply its
``exclude:`` and ``resources[].when:`` rules. A new axis is one :class:`Axis` here plus the code that reads it.

Cases expand in record order (models x gpus x tp x dcp x mtp x gmu x micro-batches x KV dtypes). Ids join the
parts in ``id_rank`` order; an axis whose part is None (a single value) adds nothing to the id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pytest_kvprofile.matrix.gpus import slugify
from pytest_kvprofile.matrix.validate import (
    MatrixError,
    _int_list,
    _mapping,
    _parse_gmu,
    _parse_gpu,
    _parse_model,
    kv_dtype_axis,
    kv_dtype_values,
    ubatch_axis,
)

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import YamlValue
    from pytest_kvprofile.matrix.gpus import GpuSpec
    from pytest_kvprofile.matrix.models import ModelSpec

Fields = dict[str, Any]  # Any: the Case fields an axis sets (model, gpu, tp, ...), each of its own type
Value = Any  # Any: one axis value (a ModelSpec, a GpuSpec, an int, a float, a dtype name or None)


@dataclass(frozen=True)
class Document:
    """A matrix file while it is read: its path, its raw YAML and what each axis parsed from it."""

    path: str
    data: dict[str, YamlValue]
    parsed: dict[str, Value] = field(default_factory=dict)


def _set_field(key: str) -> Callable[[Fields, Value], None]:
    def apply(fields: Fields, value: Value) -> None:
        fields[key] = value
    return apply


def _field_in(key: str) -> Callable[[Fields, list[YamlValue]], bool]:
    def matches(fields: Fields, wants: list[YamlValue]) -> bool:
        return bool(fields[key] in wants)
    return matches


@dataclass(frozen=True)
class RuleKey:
    """A key an ``exclude:`` or ``resources[].when:`` rule may name: its value type and how a case matches it.

    ``scalar``: the rule takes one value, not a list. ``exclude``: the key is allowed in ``exclude:`` too, not
    only in ``when:``."""

    key: str
    type: type | tuple[type, ...]
    matches: Callable[[Fields, list[YamlValue]], bool]
    scalar: bool = False
    exclude: bool = True


@dataclass(frozen=True)
class Axis:
    """One axis of a matrix.

    ``parse(document)`` checks the file's value at load (raising :class:`MatrixError`) and returns what
    ``values(document, model_name)`` expands one model's cases over. ``apply`` sets the axis's value on the case's
    fields; ``id_part`` is its part of the case id (None: no part); ``rule`` how exclusions match it (None: rules
    cannot name it). ``top_key`` is the file's key for it (None: read from elsewhere, e.g. the envelope)."""

    key: str
    parse: Callable[[Document], Value]
    values: Callable[[Document, str], list[Value]]
    id_part: Callable[[Value], str | None]
    apply: Callable[[Fields, Value], None] | None = None
    rule: RuleKey | None = None
    top_key: str | None = None
    required: bool = False
    id_rank: int = 100  # ids join parts in this order (stable): a new axis's suffix goes last

    def set(self, fields: Fields, value: Value) -> None:
        (self.apply or _set_field(self.key))(fields, value)


def _parse_models(doc: Document) -> dict[str, ModelSpec]:
    path, data = doc.path, doc.data
    models_raw = _mapping(path, "models", data["models"])
    if not models_raw:
        raise MatrixError(path, "models", "no models")
    top_kv = kv_dtype_values(path, "kv_dtype", data["kv_dtype"]) if "kv_dtype" in data else None
    models = {mname: _parse_model(path, mname, mraw) for mname, mraw in models_raw.items()}
    if top_kv is not None:  # the file's dtype for models that name none
        models = {m: spec if "kv_dtype" in models_raw[m] else dataclasses.replace(spec, kv_dtype=top_kv[0])
                  for m, spec in models.items()}
    return models


def _parse_gpus(doc: Document) -> list[GpuSpec]:
    path, raw = doc.path, doc.data["gpus"]
    if not isinstance(raw, list) or not raw:
        raise MatrixError(path, "gpus", f"expected a non-empty list, got {raw!r}")
    gpus = [_parse_gpu(path, i, g) for i, g in enumerate(raw)]
    slugs = [g.slug for g in gpus]
    if len(set(slugs)) != len(slugs):
        raise MatrixError(path, "gpus", f"duplicate GPUs in {slugs}")
    return gpus


def _int_axis(key: str, minimum: int, default: int, prefix: str, rank: int, required: bool = False) -> Axis:
    """A top-level list of integers (``tp: [1, 2]``), a Case field, in the id as ``<prefix><value>``."""
    return Axis(
        key=key, top_key=key, required=required, id_rank=rank,
        parse=lambda doc: _int_list(doc.path, key, doc.data.get(key, [default]), minimum),
        values=lambda doc, _model: list(doc.parsed[key]),
        id_part=lambda value: f"{prefix}{value}",
        rule=RuleKey(key, int, _field_in(key)),
    )


def _with_kv(fields: Fields, dtype: Value) -> None:
    if dtype is not None:
        fields["model"] = dataclasses.replace(fields["model"], kv_dtype=dtype)


def _with_ubatches(fields: Fields, count: Value) -> None:
    if count is not None:
        fields["envelope"] = dataclasses.replace(fields["envelope"], num_ubatches=count)


AXES: tuple[Axis, ...] = (
    Axis(key="model", top_key="models", required=True, id_rank=0,
         parse=_parse_models,
         values=lambda doc, model: [doc.parsed["model"][model]],
         id_part=lambda spec: spec.name,
         rule=RuleKey("model", str, lambda f, wants: f["model"].name in wants)),
    Axis(key="gpu", top_key="gpus", required=True, id_rank=4,
         parse=_parse_gpus,
         values=lambda doc, _model: list(doc.parsed["gpu"]),
         id_part=lambda gpu: gpu.slug,
         rule=RuleKey("gpu", (str, int), lambda f, wants: f["gpu"].slug in [slugify(str(w)) for w in wants])),
    _int_axis("tp", 1, 1, "tp", 1, required=True),
    _int_axis("dcp", 1, 1, "dcp", 2),
    _int_axis("mtp", 0, 0, "mtp", 3),
    Axis(key="gmu", top_key="gmu", id_rank=5,
         parse=lambda doc: _parse_gmu(doc.path, doc.data.get("gmu", [0.9])),
         values=lambda doc, _model: list(doc.parsed["gmu"]),
         id_part=lambda gmu: f"gmu{gmu:.2f}",
         rule=RuleKey("gmu", (int, float), lambda f, wants: any(abs(f["gmu"] - float(w)) < 1e-9 for w in wants))),
    # envelope.num_ubatches: [1, 2] is an axis (checked by parse_envelope); a single count adds no id part
    Axis(key="num_ubatches",
         parse=lambda doc: ubatch_axis(doc.data.get("envelope", {})),
         values=lambda doc, _model: list(doc.parsed["num_ubatches"] or [None]),
         id_part=lambda count: None if count is None else f"ub{count}",
         apply=_with_ubatches),
    # kv_dtype: a list, per model or for the file, is an axis (checked with the models); one dtype adds no id part
    Axis(key="kv_dtype", top_key="kv_dtype",
         parse=lambda doc: None,
         values=lambda doc, model: kv_dtype_axis(doc.data["models"][model], doc.data.get("kv_dtype")),
         id_part=lambda dtype: None if dtype is None else f"kv{dtype}",
         apply=_with_kv,
         rule=RuleKey("kv_dtype", str, lambda f, wants: f["model"].kv_dtype in wants)),
)
"""The axes, in expansion order."""

CONDITIONS: tuple[RuleKey, ...] = (
    RuleKey("interconnect", str, lambda f, wants: f["gpu"].interconnect in wants, exclude=False),
    RuleKey("min_tp", int, lambda f, wants: f["tp"] >= int(wants[0]), scalar=True, exclude=False),
)
"""Keys a ``resources[].when:`` rule may name that are not axes."""


def rule_keys(axes: tuple[Axis, ...] = AXES) -> dict[str, RuleKey]:
    """Every key a rule may name, axes first."""
    return {**{a.rule.key: a.rule for a in axes if a.rule is not None}, **{c.key: c for c in CONDITIONS}}


def matches(rule: dict[str, YamlValue], fields: Fields, keys: dict[str, RuleKey]) -> bool:
    """Whether a case (its fields) matches every key of an exclude/when rule."""
    for key, want in rule.items():
        if not keys[key].matches(fields, want if isinstance(want, list) else [want]):
            return False
    return True


def axes_case_id(values: tuple[Value, ...], axes: tuple[Axis, ...] = AXES) -> str:
    """The case id for one value per axis (in ``axes`` order): the non-None parts in ``id_rank`` order."""
    ranked = sorted(zip(axes, values), key=lambda pair: pair[0].id_rank)
    return "-".join(part for axis, value in ranked if (part := axis.id_part(value)) is not None)

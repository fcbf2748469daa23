"""Matrix files: YAML that names models, GPUs and parallel layouts, expanded into cases.

Expansion is deterministic (file order, then models x gpus x tp x dcp x mtp x gmu, x micro-batch counts when
``envelope.num_ubatches`` lists several: those ids end in ``-ub<N>``, x KV dtypes when ``kv_dtype`` is a list, per
model or for the whole file: those ids end in ``-kv<dtype>``; single values keep the ids unchanged), derives the
per-rank heads as docs/contract.md ("Parallel layouts") says, and keeps impossible combinations as cases that carry
a skip reason, so they show up in the id list instead of vanishing. Validation happens once, at
load; a bad file raises MatrixError naming the file and the key.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import yaml

from pytest_kvprofile.matrix.axes import AXES, Axis, Document, Fields, RuleKey, axes_case_id, matches, rule_keys
from pytest_kvprofile.matrix.cases import Case, Envelope, Matrix, Resource
from pytest_kvprofile.matrix.models import impossible_layout
from pytest_kvprofile.matrix.validate import (
    MatrixError,
    _check_type,
    _mapping,
    _unknown,
    kv_case_id,
    kv_dtype_axis,
    kv_dtype_values,
    parse_envelope,
    ubatch_axis,
    ubatch_case_id,
)
from pytest_kvprofile.units import GiB

if TYPE_CHECKING:
    from typing import Hashable

    from pytest_kvprofile.matrix.cases import YamlValue
    from pytest_kvprofile.matrix.gpus import GpuSpec
    from pytest_kvprofile.matrix.models import ModelSpec

__all__ = [
    "FIT_MARGIN_GIB", "MatrixError", "kv_case_id", "kv_dtype_axis", "kv_dtype_refusal", "kv_dtype_values",
    "load_matrices", "load_matrix", "load_matrix_text", "packaged_matrix", "parse_envelope", "parse_matrix",
    "ubatch_axis", "ubatch_case_id",
]

_FILE_KEYS = ("name", "description", "envelope", "exclude", "resources")  # the top-level keys that are not axes
_RESOURCE_KEYS = {"kind", "when", "params"}


def _parse_excludes(path: str, raw: object, keys: dict[str, RuleKey]) -> list[dict[str, YamlValue]]:
    if not isinstance(raw, list):
        raise MatrixError(path, "exclude", f"expected a list of mappings, got {type(raw).__name__}")
    allowed = {k for k, rk in keys.items() if rk.exclude}
    out = []
    for i, item in enumerate(raw):
        item = _mapping(path, f"exclude[{i}]", item)
        _unknown(path, f"exclude[{i}].", item, allowed)
        if not item:
            raise MatrixError(path, f"exclude[{i}]", "an empty exclusion would remove every case")
        _rule_values(path, f"exclude[{i}]", item, keys)
        out.append(item)
    return out


def _rule_values(path: str, where: str, rule: dict[str, YamlValue], keys: dict[str, RuleKey]) -> None:
    """An exclude/when value is a scalar of the axis's type or a non-empty list of them."""
    for key, want in rule.items():
        if keys[key].scalar:
            _check_type(path, f"{where}.{key}", want, keys[key].type)
            continue
        wants = want if isinstance(want, list) else [want]
        if not wants:
            raise MatrixError(path, f"{where}.{key}", "expected a value or a non-empty list of values")
        for w in wants:
            _check_type(path, f"{where}.{key}", w, keys[key].type)


def _parse_resources(path: str, raw: object, keys: dict[str, RuleKey]) -> list[tuple[dict[str, YamlValue], Resource]]:
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
        _unknown(path, f"{where}.when.", when, keys)
        _rule_values(path, f"{where}.when", when, keys)
        params = _mapping(path, f"{where}.params", item.get("params", {}))
        out.append((when, Resource(item["kind"], tuple(sorted(params.items())))))
    return out


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


def parse_matrix(data: object, path: str, axes: tuple[Axis, ...] = AXES) -> Matrix:
    """Validate and expand an already-parsed YAML document over ``axes`` (``matrix/axes.py``)."""
    data = _mapping(path, "<document>", data)
    _unknown(path, "", data, {*_FILE_KEYS, *(a.top_key for a in axes if a.top_key)})
    for axis in axes:
        if axis.required and axis.top_key not in data:
            raise MatrixError(path, axis.top_key or axis.key, "missing required key")
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str) or not name:
        raise MatrixError(path, "name", f"expected a non-empty string, got {name!r}")
    envelope = parse_envelope(path, data.get("envelope", {}))
    doc = Document(path, data)
    for axis in axes:
        doc.parsed[axis.key] = axis.parse(doc)
    keys = rule_keys(axes)
    excludes = _parse_excludes(path, data.get("exclude", []), keys)
    resources = _parse_resources(path, data.get("resources", []), keys)
    models = doc.parsed["model"]
    for i, rule in enumerate(excludes):
        if "model" in rule:
            for m in rule["model"] if isinstance(rule["model"], list) else [rule["model"]]:
                if m not in models:
                    raise MatrixError(path, f"exclude[{i}].model", f"unknown model {m!r}")

    matrix = Matrix(path=path, name=name, models=models)
    seen: set[str] = set()
    for mname in models:
        for values in itertools.product(*(axis.values(doc, mname) for axis in axes)):
            fields: Fields = {"envelope": envelope}
            for axis, value in zip(axes, values):
                axis.set(fields, value)
            if any(matches(rule, fields, keys) for rule in excludes):
                continue
            cid = axes_case_id(values, axes)
            if cid in seen:
                raise MatrixError(path, f"models.{mname}", f"case id {cid!r} is generated twice")
            seen.add(cid)
            carried = tuple(res for when, res in resources if matches(when, fields, keys))
            matrix.cases.append(Case(id=cid, matrix=name, skip_reason=_skip_reason(fields), resources=carried,
                                     **fields))
    return matrix


def _skip_reason(fields: Fields) -> str | None:
    """Why a case cannot run: an impossible layout, a KV dtype the GPU cannot cache, weights that do not fit."""
    model, gpu, tp, gmu = fields["model"], fields["gpu"], fields["tp"], fields["gmu"]
    reason = impossible_layout(model, tp, fields["dcp"], fields["mtp"]) or kv_dtype_refusal(model, gpu)
    if reason is None and _weights_do_not_fit(model, gpu, tp, gmu, fields["envelope"]):
        reason = (
            f"{model.name} weights ({model.weights_gib:g} GiB / tp={tp}) plus "
            f"{FIT_MARGIN_GIB} GiB of runtime headroom do not fit in "
            f"{gpu.name} memory at gmu {gmu:.2f}"
        )
    return reason


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

"""Bad matrices: random YAML and random mutations of the shipped matrices never crash the loader.

Every outcome is either a Matrix whose cases are exactly the product of its axes minus the explicit
excludes (impossible layouts kept, with a skip reason), or a MatrixError naming the file and the key.
Anything else (a KeyError, an OverflowError, a silently dropped case) fails these properties.
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pytest_kvprofile.matrix.gpus import lookup_gpu, slugify
from pytest_kvprofile.matrix.models import impossible_layout, rank_heads
from pytest_kvprofile.matrix.schema import MatrixError, load_matrix_text, parse_matrix

MATRIX_DIR = Path(__import__("pytest_kvprofile").__file__).parent / "matrices"
SHIPPED = {p.name: p.read_text(encoding="utf-8") for p in sorted(MATRIX_DIR.glob("*.yaml"))}
SHIPPED_DATA = {name: yaml.safe_load(text) for name, text in SHIPPED.items()}
_FUZZ = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None}
FUZZ = settings(max_examples=100, **_FUZZ)  # the plain run
DEEP = settings(max_examples=1000, **_FUZZ)  # pytest -m slow: test_each_property_at_depth
EXTREMES = [0, -1, 0.5, 2**53, 2**53 + 1, 2**63, 10**400, 1e308, float("inf"), float("nan")]
TOP_KEYS = ["name", "description", "envelope", "models", "gpus", "tp", "dcp", "mtp", "gmu", "exclude", "resources"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=520),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 0.9, 0.98, 1.0, 1.5, 1e308, -0.0, 15.3]),
    st.text(max_size=12),
    st.sampled_from(["L40S", "B200", "H100", "bf16", "fp8", "mla", "mha", "pcie", "nvlink", "qwen3-8b", "", "1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(TOP_KEYS)), inner, max_size=4),
    ),
    max_leaves=12,
)


def _check_error(exc: MatrixError, path: str) -> None:
    assert exc.path == path
    assert isinstance(exc.key, str) and exc.key, exc
    assert str(exc).startswith(f"{path}: {exc.key}: "), str(exc)


def _expected_points(data: dict) -> list[tuple]:
    """The cases the file asks for, computed independently of the loader."""
    models = list(data["models"])
    gpus = [lookup_gpu(g) if isinstance(g, str) else None for g in data["gpus"]]
    slugs = [g.slug if g is not None else slugify(raw["name"]) for g, raw in zip(gpus, data["gpus"])]
    tps = data["tp"]
    dcps = data.get("dcp", [1])
    mtps = data.get("mtp", [0])
    gmus = [float(x) for x in data.get("gmu", [0.9])]
    excludes = data.get("exclude", [])

    def kv_dtypes(model: str) -> list[str]:
        own = data["models"][model].get("kv_dtype", data.get("kv_dtype", "bf16"))
        return own if isinstance(own, list) else [own]

    def excluded(point: tuple) -> bool:
        model, slug, tp, dcp, mtp, gmu, kv = point
        actual = {"model": model, "gpu": slug, "tp": tp, "dcp": dcp, "mtp": mtp, "gmu": gmu, "kv_dtype": kv}
        for rule in excludes:
            hit = True
            for key, want in rule.items():
                wants = want if isinstance(want, list) else [want]
                if key == "gpu":
                    wants = [slugify(str(w)) for w in wants]
                if key == "gmu":
                    hit &= any(math.isclose(float(w), gmu, abs_tol=1e-9) for w in wants)
                else:
                    hit &= actual[key] in wants
            if hit:
                return True
        return False

    points = [(*p, kv) for m in models for p in itertools.product([m], slugs, tps, dcps, mtps, gmus)
              for kv in kv_dtypes(m)]
    return [p for p in points if not excluded(p)]


def _check_matrix(matrix: Any, data: dict) -> None:
    got = [(c.model.name, c.gpu.slug, c.tp, c.dcp, c.mtp, c.gmu, c.model.kv_dtype) for c in matrix.cases]
    assert got == _expected_points(data), "cases differ from the product of the axes minus the excludes"
    assert len({c.id for c in matrix.cases}) == len(matrix.cases)
    for case in matrix.cases:
        reason = impossible_layout(case.model, case.tp, case.dcp, case.mtp)
        if reason is not None:
            assert case.skip_reason == reason, case.id
        if case.skip_reason is None:
            rank_heads(case.model, case.tp, case.dcp)  # a runnable case has a valid per-rank layout


def _load_data(data: Any, path: str) -> None:
    try:
        matrix = parse_matrix(data, path)
    except MatrixError as exc:
        event("MatrixError")
        _check_error(exc, path)
    else:
        event("valid matrix")
        _check_matrix(matrix, data)


def _load_text(text: str, path: str) -> None:
    try:
        matrix = load_matrix_text(text, path)
    except MatrixError as exc:
        event("MatrixError")
        _check_error(exc, path)
    else:
        event("valid matrix")
        _check_matrix(matrix, yaml.safe_load(text))


# -- mutation of the shipped matrices ----------------------------------------------------------
def _positions(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_positions(v, path + (k,)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_positions(v, path + (i,)))
    return out


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


@st.composite
def plausible_exclude(draw: Any, data: dict) -> dict:
    """An exclusion that names real axis values, so that many mutants stay valid and get counted."""
    pools = {
        "model": list(data.get("models") or {"m": 0}),
        "gpu": [g if isinstance(g, str) else "X" for g in data.get("gpus") or ["L40S"]],
        "tp": [1, 2, 4, 8], "dcp": [1, 2, 4], "mtp": [0, 1, 3], "gmu": [0.9, 0.98],
    }
    keys = draw(st.lists(st.sampled_from(sorted(pools)), min_size=1, max_size=3, unique=True))
    rule = {}
    for key in keys:
        one = st.sampled_from(pools[key])
        rule[key] = draw(st.one_of(one, st.lists(one, min_size=1, max_size=3)))
    return rule


@st.composite
def mutated_matrix(draw: Any) -> tuple[str, Any]:
    name = draw(st.sampled_from(sorted(SHIPPED_DATA)))
    data = copy.deepcopy(SHIPPED_DATA[name])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_positions(data)))
        op = draw(st.sampled_from(["replace", "delete", "add", "exclude", "axis", "duplicate", "extreme",
                                   "inline-gpu"]))
        if not path:
            if op == "replace":
                data = draw(values)
            continue
        parent, last = _get(data, path[:-1]), path[-1]
        if op == "replace":
            parent[last] = draw(values)
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(st.sampled_from(TOP_KEYS + ["heads_q", "when", "params"]),
                                  st.text(max_size=6)))] = draw(values)
        elif op == "extreme" and isinstance(parent[last], (int, float)):
            parent[last] = draw(st.sampled_from(EXTREMES))
        elif op == "inline-gpu" and isinstance(data, dict) and isinstance(data.get("gpus"), list) and data["gpus"]:
            unit = draw(st.sampled_from(["memory_gib", "memory_gb"]))
            data["gpus"][0] = {"name": draw(st.sampled_from(["X1", "L40S", "big gpu"])),
                               "num_sm": draw(st.sampled_from([1, 132, *EXTREMES])),
                               unit: draw(st.sampled_from([24, 80.5, *EXTREMES]))}
        elif op == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
        elif op == "exclude" and isinstance(data, dict):
            data.setdefault("exclude", [])
            if isinstance(data["exclude"], list):
                data["exclude"].append(draw(plausible_exclude(data)))
        elif op == "axis" and isinstance(data, dict):
            axis = draw(st.sampled_from(["tp", "dcp", "mtp", "gmu", "gpus"]))
            pool = {"tp": [1, 2, 3, 4, 8, 16], "dcp": [1, 2, 3, 4], "mtp": [0, 1, 2, 3],
                    "gmu": [0.5, 0.9, 0.98, 1.0], "gpus": ["L4", "L40S", "H100", "H200", "B200", "RTX 5090"]}[axis]
            data[axis] = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        # a deletion/replacement may have removed `parent`'s siblings: positions are redrawn each round
    return name, data


def _mutated(named: tuple[str, Any]) -> None:
    name, data = named
    _load_data(data, f"mutant-of-{name}")


def _random(data: Any) -> None:
    _load_text(yaml.safe_dump(data, allow_unicode=True), "random.yaml")


random_documents = st.fixed_dictionaries({}, optional={k: values for k in TOP_KEYS}) | values
test_mutated_shipped_matrices = FUZZ(given(mutated_matrix())(_mutated))
test_random_documents = FUZZ(given(random_documents)(_random))


@st.composite
def edited_text(draw: Any) -> str:
    text = SHIPPED[draw(st.sampled_from(sorted(SHIPPED)))]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        insert = draw(st.one_of(
            st.text(max_size=6),
            st.sampled_from([":", "- ", "[", "]", "{", "}", "&a ", "*a", "\t", "\x00", "!!python/object:os.system ",
                             "!!binary ", "? ", "<<: *a", "\n  ", "1e999", ".nan", "0x10", "~", "'", '"']),
        ))
        text = text[:i] + insert + text[j:]
    return text


def _edited(text: str) -> None:
    _load_text(text, "edited.yaml")


test_edited_matrix_text = FUZZ(given(edited_text())(_edited))


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "prop"), [(mutated_matrix(), _mutated), (random_documents, _random),
                                                (edited_text(), _edited)], ids=["mutated", "random", "edited"])
def test_each_property_at_depth(strategy: Any, prop: Any) -> None:
    """The three properties above, ten times as many examples each."""
    DEEP(given(strategy)(prop))()


# -- targeted cases ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_matrices_expand_to_every_point(name: str) -> None:
    matrix = load_matrix_text(SHIPPED[name], name)
    _check_matrix(matrix, SHIPPED_DATA[name])
    small = ("ci.yaml", "hybrid.yaml", "kv-dtypes.yaml")  # small, targeted: no impossible layout among them
    assert any(c.skip_reason for c in matrix.cases) or name in small


def test_python_object_tags_are_rejected_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for text in (
        f"!!python/object/apply:os.system ['touch {marker}']\n",
        f"models: !!python/object/apply:subprocess.check_call [['touch', '{marker}']]\n",
        "name: !!python/name:os.system\n",
        "tp: !!python/object:collections.OrderedDict {}\n",
    ):
        with pytest.raises(MatrixError) as info:
            load_matrix_text(text, "evil.yaml")
        assert str(info.value).startswith("evil.yaml: line ") and "invalid YAML" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("tp: [1]\ntp: [2]\nmodels: {}\ngpus: [L4]\n", "line 2, column 1"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2, weights_gib: 1e999}\n"
          "gpus: [L4]\ntp: [1]\n"), "models.m.weights_gib"),
        (("models:\n"
          "  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2, weights_gib: 100000000000000000000000}\n"
          "gpus: [L4]\ntp: [1]\n"), "models.m.weights_gib"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [{name: big, num_sm: 1, memory_gib: 1.0e+308}]\ntp: [1]\n"), "gpus[0].memory_gib"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [L4]\ntp: [1]\nenvelope: {nontorch_mib: 1000000000000000000000000000000}\n"), "envelope.nontorch_mib"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [L4]\ntp: [1]\nexclude: [{gmu: abc}]\n"), "exclude[0].gmu"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [L4]\ntp: [1]\nexclude: [{model: [[m]]}]\n"), "exclude[0].model"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [L4]\ntp: [1]\nresources: [{kind: k, when: {min_tp: many}}]\n"), "resources[0].when.min_tp"),
        (("models:\n  m: {heads_q: 8, heads_kv: 8, head_dim: 64, num_layers: 2}\n"
          "gpus: [L4]\ntp: [1]\ngmu: [0.901, 0.904]\n"), "models.m"),
    ],
)
def test_bad_values_name_their_key(text: str, key: str) -> None:
    with pytest.raises(MatrixError) as info:
        load_matrix_text(text, "bad.yaml")
    assert info.value.key == key, str(info.value)
    _check_error(info.value, "bad.yaml")


def test_impossible_layouts_are_kept_with_a_reason() -> None:
    text = ("models:\n  m: {heads_q: 8, heads_kv: 2, head_dim: 64, num_layers: 2, weights_gib: 20}\n"
            "gpus: [L4, B200]\ntp: [1, 3, 4]\ndcp: [1, 2]\n")
    matrix = load_matrix_text(text, "keep.yaml")
    assert len(matrix.cases) == 2 * 3 * 2
    reasons = {c.id: c.skip_reason for c in matrix.cases}
    assert "does not divide the 8 query heads" in reasons["m-tp3-dcp1-mtp0-l4-gmu0.90"]
    assert "do not fit in L4" in reasons["m-tp1-dcp1-mtp0-l4-gmu0.90"]
    assert reasons["m-tp4-dcp2-mtp0-b200-gmu0.90"] is None

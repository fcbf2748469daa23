"""A matrix axis is one record (``matrix/axes.py``): ``schema.py`` loops over the records, so a new axis needs no
edit there. Shown with a toy axis (``page_size``, a list at the top of the file) passed to ``parse_matrix``."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_kvprofile.matrix.axes import AXES, Axis, RuleKey
from pytest_kvprofile.matrix.cases import layout_case
from pytest_kvprofile.matrix.schema import MatrixError, load_matrix, packaged_matrix, parse_matrix
from pytest_kvprofile.matrix.validate import _int_list


def _with_page(fields, size):
    fields["envelope"] = dataclasses.replace(fields["envelope"], page_size=size)


PAGE = Axis(
    key="page_size", top_key="page_size",
    parse=lambda doc: _int_list(doc.path, "page_size", doc.data.get("page_size", [16]), 1),
    values=lambda doc, _model: list(doc.parsed["page_size"]),
    id_part=lambda size: f"pg{size}",
    apply=_with_page,
    rule=RuleKey("page_size", int, lambda f, wants: f["envelope"].page_size in wants),
)

DOC = {
    "models": {"m": {"heads_q": 8, "heads_kv": 8, "head_dim": 128, "num_layers": 2}},
    "gpus": ["H100-SXM"],
    "tp": [1, 2],
}


def test_a_new_axis_record_expands_ids_and_exclusions_without_editing_schema():
    data = {**DOC, "page_size": [16, 32], "exclude": [{"tp": 2, "page_size": 32}]}
    matrix = parse_matrix(data, "toy.yaml", axes=(*AXES, PAGE))
    assert [c.id for c in matrix.cases] == [
        "m-tp1-dcp1-mtp0-h100-gmu0.90-pg16",
        "m-tp1-dcp1-mtp0-h100-gmu0.90-pg32",
        "m-tp2-dcp1-mtp0-h100-gmu0.90-pg16",
    ]
    assert [c.envelope.page_size for c in matrix.cases] == [16, 32, 16]
    with pytest.raises(MatrixError, match=r"page_size\[1\]: expected an integer >= 1"):
        parse_matrix({**DOC, "page_size": [16, 0]}, "toy.yaml", axes=(*AXES, PAGE))


def test_without_the_record_the_key_is_unknown():
    with pytest.raises(MatrixError, match="page_size: unknown key"):
        parse_matrix({**DOC, "page_size": [16]}, "toy.yaml")


def test_matrix_ids_agree_with_layout_case_ids():
    """The base id (before any -ub/-kv suffix) is the one ``layout_case`` gives a case outside a matrix."""
    for case in load_matrix(packaged_matrix("ci")).cases:
        alone = layout_case(case.model, case.gpu, case.tp, case.dcp, case.mtp, case.envelope, gmu=case.gmu)
        assert case.id == alone.id or case.id.startswith(f"{alone.id}-")

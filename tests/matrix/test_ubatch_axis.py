"""``envelope.num_ubatches`` as a matrix axis (issue 24, point 4): a list expands the cases and suffixes their
ids with ``-ub<N>``; a single count leaves every id as it was; a bad value is a MatrixError naming file and key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_kvprofile.matrix.schema import MatrixError, load_matrix, load_matrix_text

ROOT = Path(__file__).resolve().parents[2]
CI = (ROOT / "matrices" / "ci.yaml").read_text()


def test_a_single_count_keeps_every_shipped_id():
    ids = [c.id for c in load_matrix(ROOT / "matrices" / "ci.yaml").cases]
    assert ids[0] == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90" and not any("-ub" in i for i in ids)
    assert {c.envelope.num_ubatches for c in load_matrix(ROOT / "matrices" / "ci.yaml").cases} == {2}


def test_a_list_is_an_axis_with_suffixed_ids():
    plain = load_matrix_text(CI, "ci.yaml").cases
    axis = load_matrix_text(CI.replace("num_ubatches: 2", "num_ubatches: [1, 2]"), "ci.yaml").cases
    assert len(axis) == 2 * len(plain)
    first = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"
    assert [c.id for c in axis[:2]] == [f"{first}-ub1", f"{first}-ub2"]
    assert [c.envelope.num_ubatches for c in axis[:2]] == [1, 2]
    assert {re.sub(r"-ub\d+", "", c.id) for c in axis} == {c.id for c in plain}
    one = load_matrix_text(CI.replace("num_ubatches: 2", "num_ubatches: [2]"), "ci.yaml").cases
    assert one[0].id.endswith("-ub2")  # listed: an axis, even of one value


@pytest.mark.parametrize("value, key", [
    ("[]", "envelope.num_ubatches"),
    ("[0, 2]", r"envelope.num_ubatches\[0\]"),
    ("[1, 1]", "envelope.num_ubatches"),
    ("[1, true]", r"envelope.num_ubatches\[1\]"),
    ("'2'", "envelope.num_ubatches"),
    ("0", "envelope.num_ubatches"),
])
def test_a_bad_axis_names_file_and_key(value, key):
    with pytest.raises(MatrixError, match=rf"^ci\.yaml: {key}: "):
        load_matrix_text(CI.replace("num_ubatches: 2", f"num_ubatches: {value}"), "ci.yaml")

"""The fail-closed support declaration and its composition rule."""

import pytest

from pytest_kvprofile import DeclarationError, ProfilingSupport, declared_support, resolve_support

R, N, U = ProfilingSupport.REQUIRED, ProfilingSupport.NEUTRAL, ProfilingSupport.UNSUPPORTED


class Declares:
    def __init__(self, name, support):
        self.name = name
        self._support = support

    def get_persistent_workspace_memory_profiling_support(self):
        return self._support


class Untaught:
    name = "untaught"


def test_missing_declaration_is_unsupported():
    assert declared_support(Untaught()) is U


@pytest.mark.parametrize("answer", [True, "REQUIRED", 1, None, "required"])
def test_non_enum_answer_is_an_error_naming_the_builder(answer):
    with pytest.raises(DeclarationError, match=r"builder 'x'.*returned"):
        declared_support(Declares("x", answer))


@pytest.mark.parametrize(
    "supports, enabled, reason",
    [
        ([R], True, "REQUIRED by a0"),
        ([R, N], True, "REQUIRED by a0"),
        ([N, R, N], True, "REQUIRED by a1"),
        ([R, U], False, "'a1' is UNSUPPORTED"),
        ([U, R], False, "'a0' is UNSUPPORTED"),
        ([N], False, "every builder is NEUTRAL"),
        ([N, N], False, "every builder is NEUTRAL"),
        ([], False, "no attention metadata builders"),
    ],
)
def test_composition(supports, enabled, reason):
    res = resolve_support([Declares(f"a{i}", s) for i, s in enumerate(supports)])
    assert res.enabled is enabled
    assert reason in res.reason


def test_untaught_builder_keeps_an_opted_in_model_legacy():
    res = resolve_support([Declares("fi", R), Untaught()])
    assert not res.enabled
    assert "'untaught' is UNSUPPORTED" in res.reason
    assert res.required == ("fi",)

"""Issue 51, item 3: a transient that meets the activations at serving size (``transient_peak_profiled``).

GDN/FLA's chunked scan takes about 72 KiB per token, made and given back inside the layer's forward; vLLM's profile
run warms it at 64 tokens only. Mutant 08b re-creates it; its twins warm at the serving shape, or carve the scratch
from the reserved workspace. The plain run takes two ci cases; ``-m slow`` every runnable ci case; one case runs
alone through the plugin.
"""

from __future__ import annotations

import functools

import pytest

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.mutants_field import FIELD_TWINS, SCAN_BYTES_PER_TOKEN
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.budget import check_transient_peak_profiled
from pytest_kvprofile.checks.catalog import CheckOptions, failing_checks
from pytest_kvprofile.contract.backends import Backend, layout_refusal
from pytest_kvprofile.contract.protocol import Batch, BuilderContext, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

CHECK = "transient_peak_profiled"
MUTANT = next(b for b in MUTANT_BACKENDS if b.name == "mutant-08b-gdn-scan-warmed-at-64-tokens")
TWINS = {b.name: b for b in FIELD_TWINS if b.name.startswith("twin-08b-")}
ALONE = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"


@functools.cache
def ci_cases() -> tuple[Case, ...]:
    return tuple(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)


def plain_cases() -> list[Case]:
    cases = ci_cases()
    return [cases[0], next(c for c in cases if c.gpu.name == "B200")]


def run(backend: Backend, case: Case) -> LifecycleResult:
    result = run_lifecycle(backend, case)
    close_parts(result)
    return result


def verdicts(backend: Backend, cases: list[Case]) -> dict[str, dict[str, list[str]]]:
    return {c.id: failing_checks(run(backend, c)) for c in cases if layout_refusal(backend, c) is None}


def test_the_mutant_is_refused_with_both_figures_the_phase_the_line_and_the_fix():
    for case_id, failed in verdicts(MUTANT, plain_cases()).items():
        assert set(failed) == {CHECK}, (case_id, sorted(failed))
        text = failed[CHECK][0]
        for needle in ("gdn-scan build() of a prefill of 8192 tokens in phase 'serving'",
                       "576.00 MiB (603979776 bytes) (72.00 KiB per token", "mutants_field.py:",
                       "in ScanWarmedAtChunkBuilder.build", "activations (768.00 MiB (805306368 bytes))",
                       "peaks 1344.00 MiB (1409286144 bytes)", "The profile run saw 772.50 MiB (810024960 bytes)",
                       "at 8192 tokens", "dummy_run transient of 4.50 MiB (4718592 bytes) in phase 'profile_run'",
                       "in ScanWarmedAtChunkBuilder.dummy_run", "571.50 MiB (599261184 bytes) too little free (",
                       " KV tokens)", "Warm the scratch at the serving shape", "ctx.get_workspace"):
            assert needle in text, (needle, text)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_the_correct_twins_pass(name):
    found = verdicts(TWINS[name], plain_cases())
    assert found and not any(found.values()), found


def test_the_record_keeps_each_builds_transient_per_batch_tokens_and_the_profile_shape():
    case = ci_cases()[0]
    result = run(MUTANT, case)
    largest = case.envelope.max_num_batched_tokens
    assert result.profile_tokens == largest
    profile = [t for t in result.transients if t.builder == "gdn-scan" and t.method == "dummy_run"]
    assert {t.phase for t in profile} == {"profile_run", "profile_replay"}
    assert all(t.nbytes == 64 * SCAN_BYTES_PER_TOKEN and t.num_tokens == largest for t in profile)
    serving = {t.num_tokens: t for t in result.transients
               if t.builder == "gdn-scan" and t.method == "build" and t.phase == "serving"}
    assert largest in serving and len(serving) > 3
    # the allocator's block may be larger than asked (a remainder too small to split stays with it)
    assert all(t.largest == n * SCAN_BYTES_PER_TOKEN <= t.nbytes and t.kind != "decode" for n, t in serving.items())
    assert serving[largest].nbytes == largest * SCAN_BYTES_PER_TOKEN
    assert serving[largest].activations == 768 * MiB
    assert {t.scratch for t in profile} == {t.scratch for t in serving.values()} == {"'chunked-scan scratch'"}


class _MetadataTransient(FlashInferLikeBuilder):
    """A correct builder: its dummy_run warms a forward scratch at the serving shape, and its build makes and gives
    back 64 MiB of metadata (another tag) before the forward: judged as before, free."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        meta = ctx.allocate(64 * MiB, "kv indices")
        ctx.free(meta)
        super().build(ctx, batch)


class _NeutralScratch:
    name = "scan"

    def __init__(self, case: Case):
        self.case = case

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.NEUTRAL

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(0, 0)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        ctx.free(ctx.allocate(batch.num_tokens * SCAN_BYTES_PER_TOKEN, "never warmed scratch"))


def test_metadata_transients_and_unwarmed_scratch_are_judged_as_before():
    """Only a scratch the profile forward warmed is a forward scratch: other build transients stay free (the
    runner builds metadata before the forward), so real builders (vLLM's, SGLang's kv indices) are not refused."""
    case = ci_cases()[0]
    for backend in (Backend("metadata", lambda c: [_MetadataTransient(c)]),
                    Backend("unwarmed", lambda c: [FlashInferLikeBuilder(c), _NeutralScratch(c)])):
        result = run(backend, case)
        assert any(t.method == "build" and t.phase == "serving" and t.nbytes >= 64 * MiB for t in result.transients)
        assert check_transient_peak_profiled(result, CheckOptions()) == []


def test_vllms_own_builder_is_not_refused():
    pytest.importorskip("vllm")
    from pytest_kvprofile.engines.vllm.flashinfer import VLLM_BACKENDS

    backend = next(b for b in VLLM_BACKENDS if b.name == "vllm-flashinfer")
    result = run(backend, ci_cases()[0])
    assert any(t.method == "build" for t in result.transients)  # its metadata temporaries, a KiB or two
    assert CHECK not in failing_checks(result)


@pytest.mark.slow
def test_the_mutant_is_refused_on_every_ci_case():
    found = verdicts(MUTANT, list(ci_cases()))
    assert len(found) == 62 and all(CHECK in f for f in found.values())
    assert all(set(f) <= {CHECK, "no_post_kv_overrun"} for f in found.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TWINS))
def test_the_correct_twins_pass_every_ci_case(name):
    found = verdicts(TWINS[name], list(ci_cases()))
    assert len(found) == 62 and not any(found.values()), {c: sorted(f) for c, f in found.items() if f}


@pytest.mark.parametrize("backend", [MUTANT.name, "pytest_kvprofile.builtin.mutants_field:twins"])
def test_one_case_run_alone_through_the_plugin(pytester, backend):
    result = pytester.runpytest_inprocess(
        "--kvprofile", "--kvprofile-matrix", str(packaged_matrix("ci")), "--kvprofile-backend", backend,
        "-k", f"{CHECK} and {ALONE}", "-p", "no:cacheprovider", "-q")
    text = result.stdout.str()
    if backend.startswith("mutant"):
        assert result.ret == 1, text[-2000:]
        result.assert_outcomes(failed=1)
        assert "transient_peak_profiled: gdn-scan build()" in text and "(603979776 bytes)" in text, text[-3000:]
    else:
        assert result.ret == 0, text[-2000:]
        result.assert_outcomes(passed=len(FIELD_TWINS))

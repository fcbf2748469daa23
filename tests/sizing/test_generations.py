"""FlashInfer's planner generations: the oracle compiles against each, the sizing follows each, and says how it sized.

The engines pin different FlashInfer releases (vLLM 0.33: 0.7.2.post1, vLLM 0.34: 0.7.3, SGLang 0.5.23: 0.7.2, pie's
driver: the 0.6 generation); the suite installs 0.7.4. Tests of this module that need another release's headers
are ``slow`` (deselected from a plain run, so they never pass the CPU tier by skipping) and read them from
``$KVPROFILE_FLASHINFER_HEADERS`` (``scripts/fetch_flashinfer_headers.py``); they never download. The others run
everywhere: the family table, the Python port's and the analytic model's generations, ``sizing_method``'s reasons,
and issue 51 item 12's two incidents on the 0.6 planner's arithmetic (the installed 0.7.4 planner confirming the
fixed side).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvprofile.attention import oracle_build as ob
from pytest_kvprofile.attention.oracle import OracleError, get_oracle, indptrs
from pytest_kvprofile.attention.planner import (
    FAMILY_06,
    FAMILY_06_KV_DTYPE,
    FAMILY_06_MATERIALIZE,
    FAMILY_06_MATERIALIZE_D512,
    FAMILY_06_UNIFORM,
    FAMILY_07,
    FAMILY_07_UNFIXED,
    GENERATIONS,
    PlannerDevice,
    decode_uniform_args,
    family_of,
    prefill_plan,
)
from pytest_kvprofile.sizing import requirement
from pytest_kvprofile.sizing.analytic import PlanEnvelope
from pytest_kvprofile.sizing.requirement import required_workspace, sizing_method
from pytest_kvprofile.units import MiB

L40S = dict(num_sm=142, compute_capability=(8, 9))
L40S_DEV = PlannerDevice(142, 8, 9)
GRAPHS_512 = PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
# Issue 51 item 12, the 394 MiB incident: Qwen3-8B at TP 2 (16 q / 4 kv per rank) on an L40S, one CUDA-graph
# planned step of 300 requests and 6,848 tokens. The 0.6 planner pads it to 513 work items of 128 packed rows:
# batch_prefill_tmp_v = 16 heads x 513 x 128 x 128 x 4 B = 513 MiB, which FlashInfer's own overflow message names.
INCIDENT_QO = tuple(6848 // 300 + (1 if i < 6848 % 300 else 0) for i in range(300))
INCIDENT_KV = (4096,) * 300
TMP_V_513 = 16 * 513 * 128 * 128 * 4


def _clear() -> None:
    requirement._method_for.cache_clear()
    requirement._required.cache_clear()


@pytest.fixture
def fresh_sizing():
    """``sizing_method``/``required_workspace`` caches cleared before and after (the environment changes)."""
    _clear()
    yield
    _clear()


# -- the family table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "family"), [
    ("0.6.9", FAMILY_06_MATERIALIZE), ("0.6.12", FAMILY_06_MATERIALIZE), ("0.6.13", FAMILY_06_MATERIALIZE),
    ("0.6.14", FAMILY_06_MATERIALIZE_D512),
    ("0.6.15", FAMILY_06), ("0.6.15.post1", FAMILY_06), ("0.6.16", FAMILY_06_UNIFORM), ("0.6.17", FAMILY_06_UNIFORM),
    ("0.6.18.post1", FAMILY_06_KV_DTYPE), ("0.7.0", FAMILY_06_KV_DTYPE), ("0.7.1", FAMILY_07_UNFIXED),
    ("0.7.2", FAMILY_07_UNFIXED), ("0.7.2.post1", FAMILY_07_UNFIXED), ("0.7.3", FAMILY_07_UNFIXED),
    ("0.7.4", FAMILY_07), ("0.8.0rc1", FAMILY_07),
])
def test_family_of_follows_the_wheels(version: str, family: str) -> None:
    """Boundaries read from each wheel's scheduler.cuh and utils.cuh: VO-512 tiles 0.6.14, count-only 0.6.15,
    uniform_q_len 0.6.16, kv_dtype_bytes
    0.6.18, per-row partial outputs 0.7.1 (0.7.0 still carves per tile), fixed_uniform_q_len 0.7.4."""
    assert family_of(version) == family


def test_generations_are_ordered_and_cumulative() -> None:
    firsts = [g.first for g in GENERATIONS]
    assert firsts == sorted(firsts)
    for older, newer in zip(GENERATIONS, GENERATIONS[1:]):
        for feat in ("count_only", "uniform_q", "kv_dtype_bytes", "rows_by_group", "fixed_uniform_q", "d512_tiles"):
            assert getattr(newer, feat) >= getattr(older, feat), (newer.family, feat)


def test_installed_headers_match_the_table() -> None:
    """The installed wheel's scheduler.cuh declares what its family's row says (the oracle's -D switches come
    from the headers, the Python model from the table: they must agree)."""
    try:
        inst = ob.flashinfer_install()
    except ob.OracleUnavailable as exc:
        pytest.skip(str(exc))
    assert ob.generation_mismatch(inst) is None
    assert all(ob.header_features(inst).values()) == (inst.family == FAMILY_07)


# The declarations header_features looks for, as each generation's wheel spells them (excerpts of scheduler.cuh
# and utils.cuh of 0.6.12, 0.6.15, 0.6.16, 0.6.18.post1, 0.7.2, 0.7.4).
_SIG = {
    "d512": "  if (head_dim >= 512) {",
    "count": "inline cudaError_t PrefillPlanWorkspaceSize(",
    "uniform": "                               int64_t uniform_q_len, cudaStream_t stream) {",  # 0.6.16
    "kv": "                               uint32_t kv_dtype_bytes = 2) {",
    "rows": "    const size_t max_partial_rows =",
    "fixed": "    int64_t uniform_q_len, bool fixed_uniform_q_len, cudaStream_t stream,",
}


@pytest.mark.parametrize(("version", "parts"), [
    ("0.6.12", ()), ("0.6.14", ("d512",)), ("0.6.15", ("d512", "count")),
    ("0.6.16", ("d512", "count", "uniform")), ("0.6.18.post1", ("d512", "count", "uniform", "kv")),
    ("0.7.0", ("d512", "count", "uniform", "kv")), ("0.7.2", ("d512", "count", "uniform", "kv", "rows")),
    ("0.7.4", ("d512", "count", "uniform", "kv", "rows", "fixed")),
])
def test_header_features_select_the_signatures(tmp_path: Path, version: str, parts: tuple[str, ...]) -> None:
    """The oracle's -D switches come from the headers' text; on each generation's declarations they agree with
    the family table (so the compiled call and the Python model describe the same planner)."""
    inc = tmp_path / "flashinfer" / "data" / "include"
    sched = inc / ob.KEY_HEADERS[0]
    sched.parent.mkdir(parents=True)
    sched.write_text("\n".join(_SIG[p] for p in parts if p != "d512") + "\n")
    (inc / "flashinfer" / "utils.cuh").write_text(_SIG["d512"] if "d512" in parts else "")
    inst = ob.FlashInferInstall(version, tmp_path / "flashinfer", inc, None, installed=False)
    assert ob.generation_mismatch(inst) is None
    flags = ob._abi_flags(inst)
    assert f"-DKVP_HAS_COUNT_ONLY={int('count' in parts)}" in flags
    assert f"-DKVP_HAS_UNIFORM_Q={int('uniform' in parts)}" in flags
    assert f"-DKVP_HAS_FIXED_UNIFORM_Q={int('fixed' in parts)}" in flags
    assert f"-DKVP_HAS_KV_DTYPE_BYTES={int('kv' in parts)}" in flags


def test_a_header_the_table_does_not_know_is_named(tmp_path: Path) -> None:
    inc = tmp_path / "flashinfer" / "data" / "include"
    (inc / "flashinfer" / "attention").mkdir(parents=True)
    (inc / ob.KEY_HEADERS[0]).write_text(_SIG["count"] + "\n" + _SIG["uniform"] + "\n")
    inst = ob.FlashInferInstall("0.6.15", tmp_path / "flashinfer", inc, None, installed=False)
    assert ob.generation_mismatch(inst) == (
        "FlashInfer 0.6.15 (family 0.6): d512_tiles: headers False, table True; uniform_q: headers True, table False")


@pytest.mark.parametrize(("family", "q", "args"), [
    (FAMILY_07, 1, (1, True)), (FAMILY_07, 2, (2, True)), (FAMILY_07_UNFIXED, 1, (0, False)),
    (FAMILY_07_UNFIXED, 2, (2, False)), (FAMILY_06_UNIFORM, 2, (2, False)), (FAMILY_06, 2, (0, False)),
])
def test_decode_wrapper_arguments_by_generation(family: str, q: int, args: tuple[int, bool]) -> None:
    """decode.py of 0.6.16-0.7.2 passes ``q_len_per_req if q_len_per_req > 1 else 0``; 0.7.4 passes it always with
    ``fixed_uniform_q_len=True``; 0.6.15 has no such argument."""
    assert decode_uniform_args(family, q) == args


# -- the analytic model follows the generation -------------------------------------------------------------------


def test_float_formula_by_generation() -> None:
    """DESIGN section 4: up to 0.7.0 tmp_v = H_qo*padded*cta*D_vo*4; from 0.7.1 rows = ceil(padded*cta/group)."""
    lay = dict(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(), use_oracle=False, **L40S)
    padded, cta = 2 * 142 // 8, 128
    old = required_workspace(flashinfer_version="0.6.12", **lay)  # type: ignore[arg-type]
    new = required_workspace(flashinfer_version="0.7.2", **lay)  # type: ignore[arg-type]
    assert old.float_bytes == 32 * padded * cta * (128 + 1) * 4
    assert new.float_bytes == 32 * -(-padded * cta // 4) * (128 + 1) * 4
    assert required_workspace(flashinfer_version="0.7.0", **lay).float_bytes == old.float_bytes  # type: ignore[arg-type]


def test_tensor_core_decode_by_generation() -> None:
    """Captured MTP-1 decode (Qwen3-8B TP1, L40S): each generation's planner carves differently. Measured with each
    release's own planner (the slow test below confirms every number with the oracle of that release)."""
    env = PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(2, 4, 8, 16, 32, 64, 128, 256, 512), mtp=1)
    got = {}
    for v in ("0.6.15", "0.6.16", "0.7.2", "0.7.4"):
        r = required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=env, routes=("decode",),
                               flashinfer_version=v, use_oracle=False, **L40S)  # type: ignore[arg-type]
        got[v] = round(r.routes["decode_tc_cuda_graph"].float_bytes / MiB, 2)
    assert got == {"0.6.15": 546.23, "0.6.16": 64.5, "0.7.2": 16.12, "0.7.4": 2.2}


# -- issue 51 item 12: the incidents are caught on the older planner, not on the fixed one ------------------------


def test_64mib_incident_qwen3_8b_l40s() -> None:
    """Seed 004: a fixed 64 MiB float workspace, Qwen3-8B on an L40S (142 SMs). The 0.6 planner needs 70.55 MiB
    without CUDA graphs (the seed's rule says 96 MiB: it rounds the split bound up and adds slack); 0.7.1+ needs
    17.64 MiB. So 64 MiB overflows only on the older planner."""
    from pytest_kvprofile.sizing.rules import seed004_rule

    lay = dict(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(), **L40S)
    old = required_workspace(flashinfer_version="0.6.12", use_oracle=False, **lay)  # type: ignore[arg-type]
    new = required_workspace(**lay)  # type: ignore[arg-type]  # the installed (fixed) planner, oracle when it can
    assert old.float_bytes == 73_973_760 > 64 * MiB
    assert new.float_bytes == 32 * (35 * 128 // 4) * (128 + 1) * 4 == 18_493_440 < 64 * MiB
    assert seed004_rule(32, 8, 128, 142) == 96 * MiB >= old.float_bytes


@pytest.mark.parametrize(("hq", "hkv", "sm", "cc", "rule_mib", "need_06"), [
    (32, 8, 142, (8, 9), 96, 73_973_760), (32, 2, 142, (8, 9), 304, 300_122_112),
    (64, 8, 148, (10, 0), 176, 64 * 37 * 128 * 129 * 4),
])
def test_seed004_rule_over_approximates_the_06_planner(hq: int, hkv: int, sm: int, cc: tuple[int, int],
                                                        rule_mib: int, need_06: int) -> None:
    """The seed's table (96 / 304 / 176 MiB) is its rule, not the planner: the 0.6 planner needs less, without
    CUDA graphs (70.55 / 286.22 / 149.16 MiB, confirmed by 0.6.x's own planner in the slow test's table)."""
    from pytest_kvprofile.sizing.rules import seed004_rule

    need = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=128, num_sm=sm, compute_capability=cc,
                              envelope=PlanEnvelope(), flashinfer_version="0.6.12", use_oracle=False)
    assert seed004_rule(hq, hkv, 128, sm) == rule_mib * MiB > need.float_bytes == need_06


def test_394mib_incident_port() -> None:
    """The 394 MiB arena against a plan that asks 513 MiB of tmp_v: the 0.6 port carves it, the 0.7 one 129 MiB."""
    pages = [-(-k // 16) for k in INCIDENT_KV]
    kw = dict(heads_q=16, heads_kv=4, head_dim_qk=128, head_dim_vo=128, page_size=16, dev=L40S_DEV, cuda_graph=True)
    old = prefill_plan(FAMILY_06_MATERIALIZE, INCIDENT_QO, pages, **kw)  # type: ignore[arg-type]
    new = prefill_plan(FAMILY_07_UNFIXED, INCIDENT_QO, pages, **kw)  # type: ignore[arg-type]
    assert (old.padded_batch_size, old.cta_tile_q) == (513, 128)
    assert old.float_bytes == TMP_V_513 + TMP_V_513 // 128 > 394 * MiB
    assert new.float_bytes == 135_530_496 < 394 * MiB


def test_394mib_incident_envelope() -> None:
    """Over an envelope that can form the batch (512 sequences, graphs over 8,192-token steps) 394 MiB falls short
    on the 0.6 planner and covers the fixed one."""
    lay = dict(heads_q=16, heads_kv=4, head_dim=128, routes=("prefill",), **L40S,
               envelope=PlanEnvelope(max_num_seqs=512, cuda_graph=True))
    old = required_workspace(flashinfer_version="0.6.12", use_oracle=False, **lay)  # type: ignore[arg-type]
    new = required_workspace(flashinfer_version="0.7.4", use_oracle=False, **lay)  # type: ignore[arg-type]
    assert old.float_bytes == 810_541_056 > 394 * MiB > new.float_bytes == 202_635_264  # oracle-confirmed per release


def test_394mib_incident_installed_planner_fits(oracle_cache: object) -> None:
    """The installed (0.7.4) planner itself plans the incident's batch inside a 394 MiB arena."""
    o = get_oracle()
    if o.family != FAMILY_07:
        pytest.skip(f"installed FlashInfer is {o.version}, not the 0.7.4 this test pins")
    o.set_device(142, 8, 9)
    qo, kv = indptrs(INCIDENT_QO, INCIDENT_KV, 16)
    f, _ = o.prefill_raw(qo, kv, 16, 4, 128, 128, 16, True, materialize=True, float_capacity=394 * MiB)
    assert f == 135_530_496


# -- sizing_method: never silent --------------------------------------------------------------------------------


def test_sizing_method_names_the_oracle(oracle_cache: object, fresh_sizing: None) -> None:
    how = sizing_method()
    assert how.method == "oracle"
    assert how.flashinfer_version == ob.flashinfer_install().version
    assert "compiled for the host" in how.reason and "nvcc" in how.reason
    res = required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(), **L40S)  # type: ignore[arg-type]
    assert res.method == "oracle" and res.method_reason == how.reason


def test_sizing_method_without_nvcc(monkeypatch: pytest.MonkeyPatch, fresh_sizing: None) -> None:
    monkeypatch.setattr(requirement, "find_nvcc", lambda: None)
    how = sizing_method()
    assert how.method == "analytic"
    assert how.reason.startswith("nvcc not found on CUDA_HOME, PATH or the nvidia-cuda-nvcc wheel")
    res = required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(), **L40S)  # type: ignore[arg-type]
    assert res.method == "analytic" and res.method_reason == how.reason
    assert any(how.reason in n for n in res.notes)
    with pytest.raises(ob.OracleUnavailable, match="nvcc not found"):
        required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(), use_oracle=True,
                           **L40S)  # type: ignore[arg-type]
    assert sizing_method(use_oracle=False).reason.startswith("use_oracle=False")


def test_sizing_method_when_the_oracle_does_not_compile(oracle_cache: object, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, fresh_sizing: None) -> None:
    """A release whose planner the oracle cannot compile: the reason carries the compiler's first error line."""
    sched = tmp_path / "headers" / "0.6.99" / "flashinfer" / "data" / "include" / ob.KEY_HEADERS[0]
    sched.parent.mkdir(parents=True)
    sched.write_text("#error kvp-test: this planner changed its signature\n")
    monkeypatch.setenv(ob.HEADERS_ENV, str(tmp_path / "headers"))
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(tmp_path / "cache"))
    how = sizing_method("0.6.99")
    assert how.method == "analytic"
    assert how.reason.startswith("the oracle does not compile against flashinfer-python 0.6.99")
    assert "kvp-test: this planner changed its signature" in how.reason
    assert "\n" not in how.reason


def test_sizing_method_for_a_version_without_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     fresh_sizing: None) -> None:
    monkeypatch.setenv(ob.HEADERS_ENV, str(tmp_path))
    how = sizing_method("0.6.12")
    assert (how.method, how.family) == ("analytic", FAMILY_06_MATERIALIZE)
    assert "scripts/fetch_flashinfer_headers.py 0.6.12" in how.reason
    res = required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(),
                             flashinfer_version="0.6.12", **L40S)  # type: ignore[arg-type]
    assert res.method == "analytic" and "fetch_flashinfer_headers" in res.method_reason


# -- with other releases' headers ($KVPROFILE_FLASHINFER_HEADERS): every generation's own planner -----------------

CASES = (
    (32, 8, 128, 142, (8, 9)),  # Qwen3-8B TP1, L40S
    (32, 2, 128, 142, (8, 9)),  # the seed's 32q/2kv, L40S
    (64, 8, 128, 148, (10, 0)),  # the seed's 64q/8kv, B200
    (16, 4, 256, 132, (9, 0)),  # d256, H100
)
# (heads_q, heads_kv, head_dim_qk, head_dim_vo): MLA-shaped and asymmetric layouts, where FA2DetermineCtaTileQ moved
ODD = ((16, 1, 576, 512), (128, 1, 576, 512), (16, 16, 192, 128), (8, 1, 512, 512))
ENVS = (PlanEnvelope(), GRAPHS_512,
        PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(2, 4, 8, 16, 32, 64, 128, 256, 512), mtp=1))


def _cached() -> tuple[str, ...]:
    versions = ob.cached_versions()
    if not versions:
        pytest.skip(f"no FlashInfer headers under ${ob.HEADERS_ENV}: run scripts/fetch_flashinfer_headers.py and "
                    f"export {ob.HEADERS_ENV}")
    return versions


@pytest.mark.slow
def test_every_cached_release_compiles_and_confirms_the_model(fresh_sizing: None) -> None:
    """Each cached release: the oracle compiles against its headers, the headers match the family table, and on
    every layout x envelope the model of its family is confirmed by its own planner (method "oracle")."""
    by_family: dict[str, dict[tuple[int, int], int]] = {}
    for v in _cached():
        inst = ob.flashinfer_headers(v)
        assert ob.generation_mismatch(inst) is None
        how = sizing_method(v)
        assert how.method == "oracle", how.reason
        sizes = {}
        for i, (hq, hkv, d, sm, cc) in enumerate(CASES):
            for j, env in enumerate(ENVS):
                r = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, num_sm=sm, envelope=env,
                                       compute_capability=cc, flashinfer_version=v, use_oracle=True)
                assert r.method == "oracle" and all(rs.confirmed_by_oracle for rs in r.routes.values()), (v, r.notes)
                sizes[(i, j)] = r.float_bytes
        for hq, hkv, dqk, dvo in ODD:
            for env in ENVS:
                r = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=dqk, head_dim_vo=dvo, num_sm=132,
                                       envelope=env, flashinfer_version=v, use_oracle=True)
                assert r.method == "oracle" and all(rs.confirmed_by_oracle for rs in r.routes.values()), (v, r.notes)
                sizes[(hq * 1000 + dqk, ENVS.index(env))] = r.float_bytes
        # where two releases' planners agree the sizing agrees
        seen = by_family.setdefault(inst.family, sizes)
        assert seen == sizes, (v, inst.family)


@pytest.mark.slow
def test_incidents_on_the_real_planners() -> None:
    """Issue 51 item 12 with FlashInfer's own planners: the 0.6-generation ones (and 0.7.0) overflow a 394 MiB arena
    on the incident's batch with their own message, tmp_v 537,919,488 bytes; 0.7.1+ plan it in 129.25 MiB. And a
    64 MiB workspace overflows on the 0.6 planner's worst batch for Qwen3-8B on an L40S, not on the fixed one."""
    checked = set()
    for v in _cached():
        inst = ob.flashinfer_headers(v)
        o = get_oracle(inst)
        o.set_device(142, 8, 9)
        qo, kv = indptrs(INCIDENT_QO, INCIDENT_KV, 16)
        old = not ob.header_features(inst)["rows_by_group"]
        if old:
            with pytest.raises(OracleError, match=f"batch_prefill_tmp_v with size {TMP_V_513}"):
                o.prefill_raw(qo, kv, 16, 4, 128, 128, 16, True, materialize=True, float_capacity=394 * MiB)
        else:
            f, _ = o.prefill_raw(qo, kv, 16, 4, 128, 128, 16, True, materialize=True, float_capacity=394 * MiB)
            assert f == 135_530_496
        worst = required_workspace(heads_q=32, heads_kv=8, head_dim=128, envelope=PlanEnvelope(),
                                   flashinfer_version=v, use_oracle=True, **L40S)  # type: ignore[arg-type]
        assert worst.worst_batch is not None
        qo2, kv2 = indptrs(worst.worst_batch[0], worst.worst_batch[1], 16)
        if old:
            with pytest.raises(OracleError, match="Buffer overflow"):
                o.prefill_raw(qo2, kv2, 32, 8, 128, 128, 16, False, materialize=True, float_capacity=64 * MiB)
        else:
            o.prefill_raw(qo2, kv2, 32, 8, 128, 128, 16, False, materialize=True, float_capacity=64 * MiB)
        checked.add(old)
    if checked != {True, False}:
        pytest.skip(f"needs headers of a 0.6-generation and a 0.7.1+ release; cached: {ob.cached_versions()}")

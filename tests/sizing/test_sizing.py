"""The analytic worst case equals the oracle on its batch, and no envelope batch needs more."""

from __future__ import annotations

import time

import pytest

from pytest_kvprofile.attention.planner import FAMILY_06, FAMILY_07, family_of
from pytest_kvprofile.sizing import PlanEnvelope, required_workspace, route_results
from pytest_kvprofile.sizing.analytic import Layout, prefill_graph, prefill_nograph
from pytest_kvprofile.sizing.search import adversarial_search, oracle_evaluator, port_evaluator
from pytest_kvprofile.units import MiB

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# (heads_q, heads_kv, head_dim, head_dim_vo, num_sm): catalog GPUs, SM counts in no catalog,
# odd head layouts (5:1, 7:7 MHA, 128:1 MQA, 192/128 asymmetric, 576/512 MLA-like).
LAYOUTS = [
    (32, 8, 128, None, 142), (16, 4, 128, None, 142), (32, 2, 128, None, 142),
    (64, 8, 128, None, 148), (8, 1, 128, None, 132), (4, 1, 128, None, 188),
    (16, 2, 256, None, 170), (40, 8, 128, None, 77), (20, 4, 96, None, 200),
    (7, 7, 64, None, 58), (128, 1, 128, None, 108), (10, 2, 256, None, 33),
    (16, 16, 192, 128, 132), (128, 1, 576, 512, 132), (5, 1, 128, None, 300),
]
ENVELOPES = [
    PlanEnvelope(),
    PlanEnvelope(cuda_graph=True, cuda_graph_sizes=GRAPH_SIZES),
    PlanEnvelope(max_num_seqs=64, max_num_batched_tokens=2048, cuda_graph=True, mtp=3),
    PlanEnvelope(max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=131072, page_size=1,
             cuda_graph=True),
    PlanEnvelope(max_num_seqs=128, max_num_batched_tokens=4096, page_size=64, mtp=1),
]


def _cases():
    """Every layout under every envelope: the plain run takes each layout under one envelope (in turn), the slow
    run the rest."""
    for j, lay in enumerate(LAYOUTS):
        for i, env in enumerate(ENVELOPES):
            marks = () if i == j % len(ENVELOPES) else (pytest.mark.slow,)
            yield pytest.param(lay, env, id=f"{lay[0]}q{lay[1]}kv-d{lay[2]}-sm{lay[4]}-env{i}", marks=marks)


@pytest.mark.parametrize("layout,env", list(_cases()))
def test_analytic_is_exact_and_unbeaten(oracle, layout, env):
    hq, hkv, d, dvo, sm = layout
    for tc in (True, False):
        results = route_results(heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_vo=dvo, num_sm=sm,
                                envelope=env, routes=("prefill", "decode"),
                                decode_tensor_cores=tc, family=oracle.family, heads_q_decode=None,
                                decode_blocks_per_sm=None, compute_capability=(9, 0))
        for res in results:
            evaluate = oracle_evaluator(oracle, res, env)
            if res.batch is not None:
                got_f, _ = evaluate(res.batch)
                if res.exact:
                    assert got_f == res.float_bytes, res.route
                else:
                    assert got_f + res.gap_bytes == res.float_bytes, res.route
            t0 = time.perf_counter()
            found = adversarial_search(res, env, evaluate, n=250, seed=hash(layout) & 0xFFFF)
            elapsed = time.perf_counter() - t0
            assert found.max_float_bytes <= res.float_bytes, (res.route, found.batch)
            assert found.max_int_bytes <= res.int_bytes, (res.route, found.batch)
            assert elapsed < 1.0


@pytest.mark.parametrize("layout", LAYOUTS[:6])
def test_default_envelopes_are_exact(oracle, layout):
    hq, hkv, d, dvo, sm = layout
    for env in ENVELOPES[:2]:
        res = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_vo=dvo,
                                 num_sm=sm, envelope=env)
        assert res.exact and res.method == "oracle"
        oracle.set_device(sm)
        qo, kv, graph = res.worst_batch
        route = res.routes[res.worst_route]
        uniform = len(set(qo)) == 1 and res.worst_route.startswith("decode_tc")
        got, _ = oracle.prefill(qo, kv, heads_q=route.heads_q, heads_kv=hkv, head_dim=d,
                                head_dim_vo=dvo, page_size=env.page_size, cuda_graph=graph,
                                uniform_q_len=qo[0] if uniform else 0,
                                fixed_uniform_q_len=uniform)
        assert got == res.float_bytes
        assert len(qo) <= env.max_num_seqs and sum(qo) <= env.max_num_batched_tokens
        assert all(q <= k <= env.max_model_len for q, k in zip(qo, kv))


def test_port_matches_claims_without_oracle():
    """Analytic-only mode (no compiler): the Python port confirms the construction."""
    env = ENVELOPES[1]
    res = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142, envelope=env,
                             use_oracle=False)
    assert res.method == "analytic" and res.exact
    for r in route_results(heads_q=32, heads_kv=8, head_dim=128, head_dim_vo=None, num_sm=142,
                           envelope=env, routes=("prefill", "decode"), decode_tensor_cores=True,
                           family=FAMILY_07, heads_q_decode=None, decode_blocks_per_sm=None,
                           compute_capability=(9, 0)):
        found = adversarial_search(r, env, port_evaluator(FAMILY_07, r, env), n=100)
        assert found.max_float_bytes <= r.float_bytes


def test_repeated_calls_are_cached():
    env = PlanEnvelope(cuda_graph=True)
    a = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142, envelope=env,
                           use_oracle=False)
    t0 = time.perf_counter()
    for _ in range(1000):
        b = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142, envelope=env,
                               use_oracle=False)
    assert b is a and time.perf_counter() - t0 < 0.1


def test_dcp_decode_heads_and_bad_layouts():
    env = PlanEnvelope()
    res = required_workspace(heads_q=8, heads_kv=1, head_dim=128, num_sm=132, envelope=env,
                             heads_q_decode=32, use_oracle=False)
    assert res.routes["decode_tc"].heads_q == 32 and res.routes["prefill"].heads_q == 8
    with pytest.raises(ValueError, match="multiple"):
        required_workspace(heads_q=6, heads_kv=4, head_dim=128, num_sm=132, envelope=env,
                           use_oracle=False)


def test_version_families():
    assert family_of("0.6.9") == "0.6-materialize"
    assert family_of("0.6.13") == "0.6-materialize"
    assert family_of("0.6.14") == "0.6-materialize-d512"  # more boundaries: tests/sizing/test_generations.py
    assert family_of("0.6.15") == FAMILY_06
    assert family_of("0.7.4") == FAMILY_07
    assert family_of("0.8.0rc1") == FAMILY_07
    # The 0.6 formula does not divide by the GQA group: 4x more for Qwen3-8B without graphs.
    lay = Layout(32, 8, 128, 128, 142)
    env = PlanEnvelope()
    f06 = prefill_nograph(FAMILY_06, lay, env).float_bytes
    f07 = prefill_nograph(FAMILY_07, lay, env).float_bytes
    assert f06 == 32 * 35 * 128 * 129 * 4 and f07 * 4 == pytest.approx(f06, rel=0.01)
    assert prefill_graph(FAMILY_07, lay, PlanEnvelope(cuda_graph=True)).float_bytes > 128 * MiB


def test_fa3_int_route_flags_overflow():
    env = PlanEnvelope(max_num_seqs=2048, max_num_batched_tokens=262144, cuda_graph=True)
    res = required_workspace(heads_q=128, heads_kv=8, head_dim=128, num_sm=132, envelope=env,
                             routes=("fa3",), use_oracle=False)
    assert res.float_bytes == 0 and res.int_bytes > 8 * MiB
    assert any("8 MiB" in n or "default int" in n for n in res.notes)


def test_cuda_core_decode_with_given_occupancy(oracle):
    env = PlanEnvelope(cuda_graph=True)
    res = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142, envelope=env,
                             routes=("decode",), decode_tensor_cores=False,
                             decode_blocks_per_sm=4)
    r = res.routes["decode_cc_cuda_graph"]
    padded = 4 * 142 // 8
    assert r.float_bytes == 32 * padded * 128 * 4 + 32 * padded * 4 and r.exact
    unknown = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142, envelope=env,
                                 routes=("decode",), decode_tensor_cores=False)
    assert unknown.float_bytes >= res.float_bytes
    assert any("occupancy unknown" in n for n in unknown.notes)

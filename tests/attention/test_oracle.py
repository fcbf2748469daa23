"""The host oracle: builds without a GPU, links without libcudart, runs FlashInfer's planners."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvprofile.attention import oracle as oracle_mod
from pytest_kvprofile.attention import oracle_build
from pytest_kvprofile.attention.planner import (
    PlannerDevice,
    ceil_div,
    decode_plan,
    prefill_plan,
)


def test_library_needs_no_cuda_runtime(oracle_cache):
    _, lib = oracle_cache
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "libcudart" not in ldd and "libcuda." not in ldd
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True,
                               text=True).stdout
    assert "cuda" not in undefined.lower()


def test_hand_checked_values(oracle):
    oracle.set_device(142, 8, 9)
    # Qwen3-8B on an L40S, one 100-token prefill over 4480 cached tokens (280 pages): packed
    # length 400 -> cta_tile_q 128, 4 q tiles; max_batch_size_if_split = 284 // 8 = 35, so the
    # KV splits into 8 chunks: 32 work items, rows = ceil(32 * 128 / 4) = 1024.
    f, _ = oracle.prefill([100], [4480], heads_q=32, heads_kv=8, head_dim=128, page_size=16,
                          cuda_graph=False)
    assert f == 32 * 1024 * 128 * 4 + 32 * 1024 * 4
    # Under a CUDA graph, 8192 tokens in one request: tiles = 8192 * 4 / 128 = 256 > 35.
    f, _ = oracle.prefill([8192], [8192], heads_q=32, heads_kv=8, head_dim=128, page_size=16,
                          cuda_graph=True)
    assert f == 32 * 8192 * 128 * 4 + 32 * 8192 * 4
    # Short sequences without a graph are not split: no float workspace at all.
    f, _ = oracle.prefill([1] * 64, [16] * 64, heads_q=32, heads_kv=8, head_dim=128,
                          page_size=16, cuda_graph=False)
    assert f == 0


def test_planner_errors_come_back_as_exceptions(oracle):
    oracle.set_device(132)
    with pytest.raises(oracle_mod.OracleError, match="divisible"):
        oracle.prefill([4], [4], heads_q=6, heads_kv=4, head_dim=128, page_size=16,
                       cuda_graph=False)
    with pytest.raises(oracle_mod.OracleError, match="uniform_q_len"):
        oracle.prefill([1, 2], [4, 4], heads_q=8, heads_kv=1, head_dim=128, page_size=16,
                       cuda_graph=True, uniform_q_len=2, fixed_uniform_q_len=True)


def _random_case(rng: random.Random):
    hkv = rng.choice([1, 2, 4, 8])
    hq = hkv * rng.choice([1, 2, 3, 4, 8, 16])
    d = rng.choice([64, 128, 256, 512])
    ps = rng.choice([1, 16, 64])
    b = rng.randint(1, 48)
    graph = rng.random() < 0.5
    if rng.random() < 0.3:
        u = rng.randint(1, 4)
        qo = [u] * b
    else:
        u = 0
        qo = [rng.choice([1, 2, 7, 100, 1000]) for _ in range(b)]
    kv = [q + rng.choice([0, 5, 100, 3000, 20000]) for q in qo]
    sm = rng.choice([58, 77, 108, 132, 142, 148, 188, 200])
    return hq, hkv, d, ps, graph, u, qo, kv, sm


def test_count_only_equals_materializing_and_port(oracle):
    rng = random.Random(4)
    for _ in range(400):
        hq, hkv, d, ps, graph, u, qo, kv, sm = _random_case(rng)
        oracle.set_device(sm, 9, 0)
        kw = dict(heads_q=hq, heads_kv=hkv, head_dim=d, page_size=ps, cuda_graph=graph,
                  uniform_q_len=u, fixed_uniform_q_len=bool(u))
        count = oracle.prefill(qo, kv, materialize=False, **kw)
        mat = oracle.prefill(qo, kv, materialize=True, **kw)
        assert count == mat
        port = prefill_plan("0.7", qo, [ceil_div(k, ps) for k in kv], heads_q=hq, heads_kv=hkv,
                            head_dim_qk=d, head_dim_vo=d, page_size=ps, dev=PlannerDevice(sm, 9, 0),
                            cuda_graph=graph, uniform_q_len=u, fixed_uniform_q_len=bool(u))
        assert count == (port.float_bytes, port.int_bytes)
        if u == 0:
            bps = rng.randint(1, 8)
            dk = dict(heads_q=hq, heads_kv=hkv, head_dim=d, page_size=ps, cuda_graph=graph,
                      blocks_per_sm=bps, num_sm=sm)
            dc = oracle.decode(kv, materialize=False, **dk)
            assert dc == oracle.decode(kv, materialize=True, **dk)
            dp = decode_plan(hq, hkv, d, [ceil_div(k, ps) for k in kv], page_size=ps, num_sm=sm,
                             blocks_per_sm=bps, cuda_graph=graph)
            assert dc == (dp.float_bytes, dp.int_bytes)


def test_second_load_reuses_the_build(oracle_cache):
    root, lib = oracle_cache
    mtime = lib.stat().st_mtime_ns
    built_at = oracle_mod.build_info(lib)["built_at"]
    again = oracle_mod.ensure_built()
    assert again == lib and lib.stat().st_mtime_ns == mtime
    assert oracle_mod.build_info(lib)["built_at"] == built_at
    assert (root / "oracle").stat().st_mode & 0o777 == 0o700


def _copy_cache(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)


@pytest.mark.slow  # compiles the oracle again (nvcc, about 10 s)
def test_corrupted_library_is_rebuilt(oracle_cache, tmp_path, monkeypatch):
    root, lib = oracle_cache
    copy = tmp_path / "cache"
    _copy_cache(root, copy)
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(copy))
    clib = copy / lib.relative_to(root)
    data = clib.read_bytes()
    clib.write_bytes(data[: len(data) // 2])
    calls = []
    real = oracle_build._compile

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(oracle_build, "_compile", counting)
    rebuilt = oracle_mod.ensure_built()
    assert calls == [1]
    assert rebuilt.read_bytes() != data[: len(data) // 2]
    assert oracle_build._valid_build(rebuilt.parent)


def test_group_writable_library_is_refused(oracle_cache, tmp_path, monkeypatch):
    root, lib = oracle_cache
    copy = tmp_path / "cache"
    _copy_cache(root, copy)
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(copy))
    clib = copy / lib.relative_to(root)
    os.chmod(clib, 0o666)
    with pytest.raises(oracle_mod.OracleSecurityError, match="writable by group/others"):
        oracle_mod.ensure_built()


def _build_in_child(cache: str, queue) -> None:
    os.environ["KVPROFILE_CACHE_DIR"] = cache
    from pytest_kvprofile.attention import oracle_build as ob

    calls = []
    real = ob._compile

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    ob._compile = counting
    path = ob.ensure_built()
    queue.put((str(path), len(calls)))


@pytest.mark.slow  # compiles the oracle in several processes at once (nvcc, about 10 s)
def test_concurrent_builds_produce_one_library(oracle_cache, tmp_path):
    cache = tmp_path / "fresh"
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(cache), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len({path for path, _ in results}) == 1
    assert sum(n for _, n in results) == 1, results
    libs = list((cache / "oracle").glob("*/" + oracle_mod.LIB_NAME))
    assert len(libs) == 1
    assert not list((cache / "oracle").glob(".build-*"))


def test_no_compiler_raises_with_install_hint(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setattr(oracle_build.importlib.util, "find_spec",
                        lambda name, *a: None if name == "nvidia" else _real_find_spec(name))
    ok, why = oracle_mod.oracle_available()
    assert not ok and "pip install pytest-kvprofile[nvcc]" in why
    with pytest.raises(oracle_mod.OracleUnavailable, match=r"pytest-kvprofile\[nvcc\]"):
        oracle_mod.ensure_built()


_real_find_spec = oracle_build.importlib.util.find_spec


def test_compiler_failure_reports_command_and_stderr(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    nvcc = fake / "nvcc"
    nvcc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake nvcc 1.0'; exit 0; fi\n"
                    "echo 'fatal: simulated failure' >&2\nexit 3\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(tmp_path / "c"))
    with pytest.raises(oracle_mod.OracleBuildError) as info:
        oracle_mod.ensure_built()
    msg = str(info.value)
    assert "simulated failure" in msg and str(nvcc) in msg and "oracle.cu" in msg


FAKE_CUDART = r"""
int cudaGetDevice(int* d) { *d = 0; return 0; }
int cudaDeviceGetAttribute(int* v, int attr, int dev) { *v = attr == 16 ? 999 : 9; return 0; }
int cudaMemcpyAsync(void* d, const void* s, unsigned long n, int k, void* st) { return 0; }
const char* cudaGetErrorString(int e) { return "fake cudart"; }
"""

ISOLATION_CHILD = r"""
import ctypes, json, os, sys
ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)  # what a CUDA torch does with libcudart before we load
from pytest_kvprofile.attention.oracle import get_oracle
o = get_oracle()
out = {}
for sm in (8, 132):
    o.set_device(sm, 9, 0)
    out[sm] = o.prefill([100], [4480], heads_q=32, heads_kv=8, head_dim=128, page_size=16, cuda_graph=False)[0]
print(json.dumps(out))
"""


def test_stub_runtime_is_hidden_and_bound_inside(oracle_cache):
    exported = subprocess.run(["nm", "-D", "--defined-only", str(oracle_cache.lib)], capture_output=True,
                              text=True).stdout
    leaked = [ln.split()[-1] for ln in exported.splitlines() if re.match(r"_*cuda[A-Z]", ln.split()[-1])]
    assert leaked == [], f"the stub CUDA runtime is exported: {leaked}"


def test_a_global_fake_cudart_does_not_answer_for_the_oracle(oracle_cache, tmp_path):
    """A libcudart loaded RTLD_GLOBAL first (999 SMs) must not replace the SM count the oracle was given."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcudart")
    src = tmp_path / "fake_cudart.c"
    src.write_text(FAKE_CUDART)
    lib = tmp_path / "libcudart.so.13"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    env = dict(os.environ, KVPROFILE_CACHE_DIR=str(oracle_cache.root))
    proc = subprocess.run([sys.executable, "-c", ISOLATION_CHILD, str(lib)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = {int(k): v for k, v in json.loads(proc.stdout).items()}
    want = {sm: prefill_plan("0.7", [100], [280], heads_q=32, heads_kv=8, head_dim_qk=128, head_dim_vo=128,
                             page_size=16, dev=PlannerDevice(sm, 9, 0), cuda_graph=False).float_bytes
            for sm in (8, 132, 999)}
    assert want[8] != want[999] and want[132] != want[999]
    assert got == {8: want[8], 132: want[132]}

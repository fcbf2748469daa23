"""Measure the oracle: cold build, warm start, queries per second, adversarial search per case.

Run ``python -m pytest_kvprofile.sizing.bench`` (uses a temp cache for the cold build). The
numbers go into docs/sizing.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _warm_start_seconds(cache: str) -> float:
    code = ("import time; t=time.perf_counter(); "
            "from pytest_kvprofile.attention.oracle import get_oracle; o=get_oracle(); "
            "o.set_device(142); o.prefill([100],[4480],heads_q=32,heads_kv=8,head_dim=128,"
            "page_size=16,cuda_graph=False); print(time.perf_counter()-t)")
    env = {**os.environ, "KVPROFILE_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    return float(out.stdout.strip())


def main() -> dict[str, object]:
    from array import array

    from pytest_kvprofile.attention.oracle import (
        build_info,
        ensure_built,
        get_oracle,
        indptrs,
    )
    from pytest_kvprofile.sizing.analytic import PlanEnvelope
    from pytest_kvprofile.sizing.requirement import route_results
    from pytest_kvprofile.sizing.search import adversarial_search, oracle_evaluator

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["KVPROFILE_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        lib = ensure_built()
        results["cold_build_s"] = round(time.perf_counter() - t0, 2)
        results["compile_s"] = build_info(lib).get("build_seconds")
        results["warm_start_s"] = round(min(_warm_start_seconds(cache) for _ in range(3)), 3)
        oracle = get_oracle()
        oracle.set_device(142)
        for batch in (1, 32, 256):
            qo, kv = indptrs([7] * batch, [3000] * batch, 16)
            n = 20000
            t0 = time.perf_counter()
            for _ in range(n):
                oracle.prefill_raw(qo, kv, 32, 8, 128, 128, 16, True)
            results[f"qps_prefill_batch{batch}"] = int(n / (time.perf_counter() - t0))
        qo = array("i", [0, 100])
        kv = array("i", [0, 280])
        t0 = time.perf_counter()
        for _ in range(20000):
            oracle.prefill_raw(qo, kv, 32, 8, 128, 128, 16, False)
        results["qps_prefill_batch1_nograph"] = int(20000 / (time.perf_counter() - t0))
        env = PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        times = []
        for lay in ((32, 8, 128, 142), (8, 1, 128, 132), (64, 8, 128, 148), (32, 2, 256, 188)):
            for res in route_results(heads_q=lay[0], heads_kv=lay[1], head_dim=lay[2],
                                     head_dim_vo=None, num_sm=lay[3], envelope=env,
                                     routes=("prefill", "decode"), decode_tensor_cores=True,
                                     family=oracle.family, heads_q_decode=None,
                                     decode_blocks_per_sm=None, compute_capability=(9, 0)):
                t0 = time.perf_counter()
                adversarial_search(res, env, oracle_evaluator(oracle, res, env), n=200)
                times.append((time.perf_counter() - t0) * 1000)
        results["search_ms_per_case_200_batches"] = {
            "mean": round(sum(times) / len(times), 1), "max": round(max(times), 1)}
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))

"""SGLang's facts, each defined once: its default float workspace, its KV-dtype names, its FlashInfer pin.

Registered through ``pytest_kvprofile_register`` (``registry.add_engine_facts``), so the sizing report reads them
without naming SGLang (``matrix.engine_facts``). SGLang states no route policy: its cases are sized under the one a
registered engine states, as every backend's are (its own decode rule, ``should_use_tensor_core``, also reads the KV
dtype).
"""

from __future__ import annotations

from pytest_kvprofile.matrix.engine_facts import EngineFacts, FloatWorkspaceRule
from pytest_kvprofile.units import MiB

SGLANG_FLOAT_BYTES = 384 * MiB  # SGLang's global FlashInfer float workspace
DEFAULT_WORKSPACE = FloatWorkspaceRule("sglang", SGLANG_FLOAT_BYTES)

# The matrix's KV dtype names to SGLang's --kv-cache-dtype; fp32 has none here (SGLang's float caches are the
# model's dtype, which this adapter makes bf16 or fp16).
KV_CACHE_DTYPES: dict[str, str] = {
    "bf16": "auto", "auto": "auto", "fp16": "auto",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "nvfp4": "nvfp4",
}

FLASHINFER_PINS: dict[str, str] = {"0.5.23": "0.7.2"}  # the flashinfer-python each SGLang release pins

SGLANG_FACTS = EngineFacts(name="sglang", kv_cache_dtypes=KV_CACHE_DTYPES, float_workspaces=(DEFAULT_WORKSPACE,),
                           flashinfer_pins=FLASHINFER_PINS)

"""vLLM's facts, each defined once: its default workspaces, its KV-dtype names, its route policy, its FlashInfer pins.

Registered through ``pytest_kvprofile_register`` (``registry.add_engine_facts``), so the matrix, the sizing and the
stubs read them without naming vLLM (``matrix.engine_facts``). The cases are sized under vLLM's route policy: the
contract the suite judges is the one vLLM's runner keeps (docs/architecture.md, "Where facts live").
"""

from __future__ import annotations

from pytest_kvprofile.matrix.engine_facts import EngineFacts, FloatWorkspaceRule, RoutePolicy, TrtllmOnly
from pytest_kvprofile.units import MiB

# VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE: vLLM's default FlashInfer float workspace, and its trtllm-gen workspace
VLLM_DEFAULT_FLOAT_BYTES = 394 * MiB
# vLLM grows its default float workspace to batched tokens x rank query heads x head dim x 16 B
VLLM_DEFAULT_FLOAT_BYTES_PER_ELEMENT = 16
DEFAULT_WORKSPACE = FloatWorkspaceRule("vllm-default", VLLM_DEFAULT_FLOAT_BYTES, VLLM_DEFAULT_FLOAT_BYTES_PER_ELEMENT)

# The matrix's KV dtype names to vLLM's --kv-cache-dtype ("auto": the model's dtype; "fp8" is E4M3 on CUDA).
KV_CACHE_DTYPES: dict[str, str] = {
    "bf16": "auto", "auto": "auto", "fp16": "auto", "fp32": "auto",
    "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "nvfp4": "nvfp4",
}

# vLLM's FlashInfer backend plans decode on tensor cores from a GQA group of 4, and always under MTP. It reads NVFP4
# with FA2 (packed uint8) on SM8x/9x/12x and with trtllm-gen only on SM10x (FlashInferBackend.supports_kv_cache_dtype).
ROUTE_POLICY = RoutePolicy(
    decode_tensor_cores_min_group=4, decode_tensor_cores_under_mtp=True,
    trtllm_only={"nvfp4": TrtllmOnly((10, 11), "vLLM's FlashInfer backend reads it with FA2 on SM8x/9x/12x only")},
)

# The flashinfer-python each vLLM release pins (DESIGN section 9), whose planners the sizing must follow.
# 0.34's 0.7.3 is not on PyPI (0.7.2.post1 is followed by 0.7.4); the family table places it with 0.7.2.
FLASHINFER_PINS: dict[str, str] = {"0.33": "0.7.2.post1", "0.34": "0.7.3"}

VLLM_FACTS = EngineFacts(
    name="vllm", kv_cache_dtypes=KV_CACHE_DTYPES, float_workspaces=(DEFAULT_WORKSPACE,),
    trtllm_workspace_bytes=VLLM_DEFAULT_FLOAT_BYTES, route_policy=ROUTE_POLICY, flashinfer_pins=FLASHINFER_PINS,
)

"""FlashInfer's and the engines' fixed sizes, each defined once (design brief §4 and §7).

Why one module: the 8 MiB int workspace and the engines' default float workspaces are read by the sizing, the
stubs, the real-FlashInfer backend, the vLLM adapter and the GPU builders; a second definition could drift.
"""

from __future__ import annotations

from pytest_kvprofile.units import MiB

# what every FlashInfer wrapper allocates for its int workspace (and pinned mirror)
FLASHINFER_INT_WORKSPACE_BYTES = 8 * MiB
FLASHINFER_RECOMMENDED_FLOAT_BYTES = 128 * MiB  # FlashInfer's recommended flat float workspace
VLLM_DEFAULT_FLOAT_BYTES = 394 * MiB  # VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE; also vLLM's trtllm-gen workspace
SGLANG_FLOAT_BYTES = 384 * MiB
TENSORRT_LLM_FLOAT_BYTES = 320 * MiB  # per attention metadata object

# The flashinfer-python each engine release pins (DESIGN section 9), whose planners the sizing must follow.
# vLLM 0.34's 0.7.3 is not on PyPI (0.7.2.post1 is followed by 0.7.4); the family table places it with 0.7.2.
FLASHINFER_PINS: dict[str, str] = {
    "vllm 0.33": "0.7.2.post1",
    "vllm 0.34": "0.7.3",
    "sglang 0.5.23": "0.7.2",
    "pie cuda_native (0.6 generation)": "0.6.12",
}
FLASHINFER_SUITE_VERSION = "0.7.4"  # what the suite installs

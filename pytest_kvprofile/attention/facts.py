"""FlashInfer's fixed sizes, each defined once (design brief §4 and §7).

Why one module: the 8 MiB int workspace and FlashInfer's recommended float workspace are read by the sizing, the
stubs, the real-FlashInfer backend, the engine adapters and the GPU builders; a second definition could drift. An
engine's own sizes, KV-dtype names, route policy and FlashInfer pins are its package's (``engines/<name>/facts.py``,
read through ``matrix.engine_facts``).
"""

from __future__ import annotations

from pytest_kvprofile.units import MiB

# what every FlashInfer wrapper allocates for its int workspace (and pinned mirror)
FLASHINFER_INT_WORKSPACE_BYTES = 8 * MiB
FLASHINFER_RECOMMENDED_FLOAT_BYTES = 128 * MiB  # FlashInfer's recommended flat float workspace
TENSORRT_LLM_FLOAT_BYTES = 320 * MiB  # TensorRT-LLM's, per attention metadata object: a published size, no engine here
FLASHINFER_SUITE_VERSION = "0.7.4"  # what the suite installs

"""FlashInfer's fixed sizes, still importable here for backends written against earlier releases.

Each is defined once, in ``pytest_kvprofile/attention/facts.py`` (FlashInfer's home in this package). An engine's
default float workspace is its package's (``engines/<name>/facts.py``, read through ``matrix.engine_facts``).
"""

from __future__ import annotations

from pytest_kvprofile.attention.facts import (
    FLASHINFER_INT_WORKSPACE_BYTES,
    FLASHINFER_RECOMMENDED_FLOAT_BYTES,
    TENSORRT_LLM_FLOAT_BYTES,
)

__all__ = [
    "FLASHINFER_INT_WORKSPACE_BYTES",
    "FLASHINFER_RECOMMENDED_FLOAT_BYTES",
    "TENSORRT_LLM_FLOAT_BYTES",
]

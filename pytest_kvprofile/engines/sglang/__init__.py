"""SGLang's own attention backends under the harness: its facts, its paths (static and post-capture KV sizing) and its
registration. ``flashinfer.py`` drives ``FlashInferAttnBackend`` as SGLang's model runner integrates it;
``trtllm_mha.py`` and ``trtllm_mla.py`` its Blackwell defaults; ``post_capture.py`` the post-capture path;
``memory.py`` SGLang's memory model; ``facts.py`` its workspace, KV-dtype names and FlashInfer pin; ``standins.py``
what a CPU-only machine lacks (docs/sglang.md). SGLang is imported by ``make_builders`` only, never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_kvprofile.engines import hookimpl

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import BackendRegistrar


@hookimpl(tryfirst=True)
def pytest_kvprofile_register(registry: BackendRegistrar) -> None:
    """SGLang's facts and its own backends, on its static and post-capture KV sizing paths."""
    from pytest_kvprofile.engines.sglang.facts import SGLANG_FACTS
    from pytest_kvprofile.engines.sglang.flashinfer import SGLANG_BACKENDS
    from pytest_kvprofile.engines.sglang.post_capture import SGLANG_POST_CAPTURE_BACKENDS
    from pytest_kvprofile.engines.sglang.trtllm_mha import SGLANG_TRTLLM_MHA_BACKENDS
    from pytest_kvprofile.engines.sglang.trtllm_mla import SGLANG_TRTLLM_MLA_BACKENDS

    registry.add_engine_facts(SGLANG_FACTS)
    registry.add_backends(*SGLANG_BACKENDS)
    registry.add_backends(*SGLANG_POST_CAPTURE_BACKENDS)
    registry.add_backends(*SGLANG_TRTLLM_MHA_BACKENDS)
    registry.add_backends(*SGLANG_TRTLLM_MLA_BACKENDS)

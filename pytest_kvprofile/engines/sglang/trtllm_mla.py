"""The ``sglang-trtllm-mla`` backend: SGLang's own, unmodified ``TRTLLMMLABackend``
(``sglang/srt/layers/attention/trtllm_mla_backend.py``, ``--attention-backend trtllm_mla``, SGLang's MLA default on
Blackwell) driven through the lifecycle on the simulated GPU, on SGLang's static path (SGLang sizes MLA statically).

Why: on SM100 SGLang serves MLA models with FlashInfer's trtllm-gen MLA kernels, which plan nothing; FlashInfer's own
MLA wrapper plans there on CuTe-DSL or trtllm-gen, which the simulated GPU cannot plan, so ``sglang-flashinfer``
refuses those cases. ``TRTLLMMLABackend`` subclasses ``FlashInferMLAAttnBackend`` and calls its constructor first, so
it also makes SGLang's MLA float workspace (384 MiB) and FlashInfer's MLA wrappers, which it never plans into, beside
its own zeroed trtllm-gen workspace (``get_buffer("trtllm_mla_zero_workspace")``, 150 MiB). SGLang raises the page
size to 64 for it ("TensorRT-LLM MLA only supports page_size of 32 or 64"); the runner takes SGLang's resolved one.

What the adapter adds to ``sglang-flashinfer``'s (``engines/sglang/flashinfer.py``): the attention backend in the
case's ``ServerArgs``, the backend class, the host version of its block-table kernel
(:class:`HostFlashMlaKvIndices`) and a stand-in for the CUDA module it JIT-compiles at construction.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.engines.adapter import Patches
from pytest_kvprofile.engines.sglang.flashinfer import (
    SglangFlashInferAdapter,
    SglangValue,
    engine_refusal,
    sglang_backend,
)

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["ATTENTION_BACKEND", "SGLANG_TRTLLM_MLA_BACKENDS", "HostFlashMlaKvIndices", "SglangTrtllmMlaAdapter",
           "trtllm_mla_refusal"]

BACKEND_NAME = "sglang-trtllm-mla"
ATTENTION_BACKEND = "trtllm_mla"
_MODULE = "sglang.srt.layers.attention.trtllm_mla_backend"


class HostFlashMlaKvIndices:
    """SGLang's ``create_flashmla_kv_indices_triton[grid](req_to_token, req_pool_indices, page_kernel_lens,
    kv_start_idx, kv_indices, req_to_token_stride, kv_indices_stride, PAGED_SIZE=)`` (a Triton kernel) on the host:
    row ``b`` of ``kv_indices`` gets the block id (``slot // PAGED_SIZE``) of each of the ``cdiv(len_b, PAGED_SIZE)``
    pages of request ``b``'s ``req_to_token`` row from ``kv_start_idx[b]``; the rest of the row is left as it was, as
    the kernel leaves it. One program row per request (grid axis 0)."""

    def __getitem__(self, grid: SglangValue) -> SglangValue:
        return self._launch

    @staticmethod
    def _launch(req_to_token: SglangValue, req_pool_indices: SglangValue, page_kernel_lens: SglangValue,
                kv_start_idx: SglangValue, kv_indices: SglangValue, req_to_token_ptr_stride: int,
                kv_indices_ptr_stride: int, PAGED_SIZE: int = 64) -> None:  # noqa: N803 - the kernel's names
        table, out = req_to_token.numpy(), kv_indices.numpy()
        rows, lens = req_pool_indices.numpy(), page_kernel_lens.numpy()
        starts = kv_start_idx.numpy() if kv_start_idx is not None else None
        for b in range(min(len(lens), out.shape[0])):
            start = int(starts[b]) if starts is not None else 0
            pages = min(-(-int(lens[b]) // PAGED_SIZE), out.shape[1])
            out[b, :pages] = table[int(rows[b]), start:start + pages * PAGED_SIZE:PAGED_SIZE] // PAGED_SIZE


def _no_jit_module(dtype: SglangValue) -> None:
    """SGLang JIT-compiles its ``fixup_zero_kv`` CUDA module when the backend is made (a prebuild; the module is
    launched by a zero-KV prefill's forward only, never by metadata). No CUDA compiler serves the CPU tier."""
    return None


@contextlib.contextmanager
def host_trtllm_mla_kernels() -> Iterator[None]:
    """The backend module's block-table kernel on the host and its JIT prebuild stood in, for the block."""
    import importlib

    module = importlib.import_module(_MODULE)
    patches = Patches()
    patches.set(module, "create_flashmla_kv_indices_triton", HostFlashMlaKvIndices())
    patches.set(module, "_jit_fixup_module", _no_jit_module)
    try:
        yield
    finally:
        patches.undo()


class SglangTrtllmMlaAdapter(SglangFlashInferAdapter):
    """SGLang's ``TRTLLMMLABackend`` as its model runner integrates it (as ``sglang-flashinfer``'s, after the KV
    pools); declares nothing (UNSUPPORTED: the legacy path)."""

    name = BACKEND_NAME
    builder_label = "SGLang's TRTLLMMLABackend"
    attention_backend = ATTENTION_BACKEND
    backend_module = _MODULE
    backend_class = "TRTLLMMLABackend"

    def host_kernels(self) -> contextlib.AbstractContextManager[None]:
        return host_trtllm_mla_kernels()


def trtllm_mla_refusal(case: Case) -> str | None:
    """Why SGLang (its validation of ``--attention-backend trtllm_mla`` on the case's GPU, its registry's MLA-only
    rule) or the adapter refuses ``case``."""
    return engine_refusal(case, ATTENTION_BACKEND)


SGLANG_TRTLLM_MLA_BACKENDS: tuple[Backend, ...] = (
    sglang_backend(BACKEND_NAME, SglangTrtllmMlaAdapter,
                   "SGLang's own TRTLLMMLABackend (--attention-backend trtllm_mla, SGLang's MLA default on "
                   "Blackwell; static KV sizing), unmodified, on the simulated GPU"),
)


def backends() -> list[Backend]:
    return list(SGLANG_TRTLLM_MLA_BACKENDS)

"""The ``sglang-trtllm-mha`` backend: SGLang's own, unmodified ``TRTLLMHAAttnBackend``
(``sglang/srt/layers/attention/trtllm_mha_backend.py``, ``--attention-backend trtllm_mha``, SGLang's MHA default on
Blackwell) driven through the lifecycle on the simulated GPU, on SGLang's static path.

Why: on SM100 SGLang serves MHA models with FlashInfer's trtllm-gen kernels, which plan nothing: the backend builds
its own page tables and sequence lengths. But it subclasses ``FlashInferAttnBackend`` and calls its constructor
first, so it also makes FlashInfer's process-wide float workspace (384/512 MiB) and its eager wrappers, which it never
plans into, beside its own zeroed trtllm-gen workspace (``get_buffer("trtllm_mha_zero_workspace")``, 512 MiB by
default). The verdict is the legacy path with its cost, by source line; the unused FlashInfer arena shows there as its
own line, and ``docs/sglang-results.md`` as waste (no route plans into it: its exact need is zero).

What the adapter adds to ``sglang-flashinfer``'s (``engines/sglang/flashinfer.py``): the attention backend in the
case's ``ServerArgs`` (SGLang's own validation refuses what it refuses), the backend class, and host versions of
its two Triton kernels (:func:`host_page_table`, :func:`host_graph_metadata`). Builds go through the same calls
(``init_forward_metadata``, ``init_forward_metadata_out_graph``).
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

__all__ = ["ATTENTION_BACKEND", "SGLANG_TRTLLM_MHA_BACKENDS", "SglangTrtllmMhaAdapter", "host_graph_metadata",
           "host_page_table", "trtllm_refusal"]

BACKEND_NAME = "sglang-trtllm-mha"
ATTENTION_BACKEND = "trtllm_mha"
_MODULE = "sglang.srt.layers.attention.trtllm_mha_backend"


def _swa_refused(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what}: the host version does not translate sliding-window (SWA) pools; no matrix "
                               "case has one")


def _pages(seq_len: int, page_size: int, limit: int) -> int:
    return min(-(-seq_len // page_size), limit)


def host_page_table(req_to_token: SglangValue, req_pool_indices: SglangValue, cache_seqlens: SglangValue,
                    page_table: SglangValue, page_size: int, swa_page_table: SglangValue = None,
                    full_to_swa: SglangValue = None) -> None:
    """SGLang's ``build_trtllm_mha_page_table`` (the Triton kernel ``create_trtllm_mha_kv_indices_triton``) on the
    host: row ``i`` of ``page_table`` gets the block id (``slot // page_size``) of each page of request ``i``'s
    ``req_to_token`` row, for its ``cdiv(cache_seqlens[i], page_size)`` live pages; the rest of the row is left as
    it was, as the kernel leaves it."""
    if full_to_swa is not None or swa_page_table is not None:
        raise _swa_refused("build_trtllm_mha_page_table")
    bs, width = page_table.shape
    rows, lens = req_pool_indices.numpy(), cache_seqlens.numpy()
    table, out = req_to_token.numpy(), page_table.numpy()
    for i in range(bs):
        n = _pages(int(lens[i]), page_size, width)
        out[i, :n] = table[int(rows[i]), 0:n * page_size:page_size] // page_size


def host_graph_metadata(*, req_pool_indices: SglangValue, seq_lens: SglangValue, req_to_token: SglangValue,
                        cache_seqlens: SglangValue, cu_seqlens_k: SglangValue, page_table: SglangValue, bs: int,
                        seqlen_offset: int, max_seq_pages: int, page_size: int, swa_mapping: SglangValue = None,
                        swa_page_table: SglangValue = None, out_cache_loc: SglangValue = None,
                        swa_out_cache_loc: SglangValue = None, cu_seqlens_q: SglangValue = None,
                        qlens: SglangValue = None, q_stride: int = 0, q_mode: int = 0,
                        skip_page_table: bool = False) -> None:
    """SGLang's ``update_trtllm_mha_graph_metadata`` (one fused Triton kernel per replay) on the host:
    ``cache_seqlens = seq_lens + seqlen_offset``, ``cu_seqlens_k[1:] = cumsum``, the live prefix of each page-table
    row, and ``cu_seqlens_q`` by ``q_mode`` (1: cumsum of ``qlens``; 2: ``arange x q_stride``)."""
    import numpy as np

    if bs == 0:
        return
    if swa_page_table is not None or swa_out_cache_loc is not None:
        raise _swa_refused("update_trtllm_mha_graph_metadata")
    seq = seq_lens.numpy()[:bs].astype(np.int64) + seqlen_offset
    cache_seqlens.numpy()[:bs] = seq
    cu_seqlens_k.numpy()[1:bs + 1] = np.cumsum(seq)
    if not skip_page_table:
        rows, table, out = req_pool_indices.numpy(), req_to_token.numpy(), page_table.numpy()
        for i in range(bs):
            n = _pages(int(seq[i]), page_size, max_seq_pages)
            out[i, :n] = table[int(rows[i]), 0:n * page_size:page_size] // page_size
    if q_mode == 1:
        cu_seqlens_q.numpy()[1:bs + 1] = np.cumsum(qlens.numpy()[:bs])
    elif q_mode == 2:
        cu_seqlens_q.numpy()[1:bs + 1] = np.arange(1, bs + 1) * q_stride


@contextlib.contextmanager
def host_trtllm_kernels() -> Iterator[None]:
    """The backend module's two Triton launches are the host versions for the block."""
    import importlib

    module = importlib.import_module(_MODULE)
    patches = Patches()
    patches.set(module, "build_trtllm_mha_page_table", host_page_table)
    patches.set(module, "update_trtllm_mha_graph_metadata", host_graph_metadata)
    try:
        yield
    finally:
        patches.undo()


class SglangTrtllmMhaAdapter(SglangFlashInferAdapter):
    """SGLang's ``TRTLLMHAAttnBackend`` as its model runner integrates it (as ``sglang-flashinfer``'s, after the KV
    pools); declares nothing (UNSUPPORTED: the legacy path)."""

    name = BACKEND_NAME
    builder_label = "SGLang's TRTLLMHAAttnBackend"
    attention_backend = ATTENTION_BACKEND
    backend_module = _MODULE
    backend_class = "TRTLLMHAAttnBackend"

    def host_kernels(self) -> contextlib.AbstractContextManager[None]:
        return host_trtllm_kernels()

    def wrappers(self) -> Iterator[tuple[str, SglangValue]]:
        """FlashInfer's eager wrappers its parent's constructor made (never planned: trtllm-gen plans nothing)."""
        for backend in self.builders.values():
            yield "ragged prefill (unused)", backend.prefill_wrapper_ragged
            for role, attr in (("paged prefill (unused)", "prefill_wrappers_paged"),
                               ("decode (unused)", "decode_wrappers")):
                for w in getattr(backend, attr, []):
                    yield role, w


def trtllm_refusal(case: Case) -> str | None:
    """Why SGLang (its validation of ``--attention-backend trtllm_mha`` on the case's GPU) or the adapter refuses
    ``case``."""
    return engine_refusal(case, ATTENTION_BACKEND)


SGLANG_TRTLLM_MHA_BACKENDS: tuple[Backend, ...] = (
    sglang_backend(BACKEND_NAME, SglangTrtllmMhaAdapter,
                   "SGLang's own TRTLLMHAAttnBackend (--attention-backend trtllm_mha, SGLang's MHA default on "
                   "Blackwell; static KV sizing), unmodified, on the simulated GPU"),
)


def backends() -> list[Backend]:
    return list(SGLANG_TRTLLM_MHA_BACKENDS)

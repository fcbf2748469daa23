"""SGLang's model runner as the adapters drive it: a real ``ReqToTokenPool`` and ``KVIndexTranslator``, a KV pool
stand-in answering SGLang's KV quantization method (the harness owns the KV cache), the capture-stable input buffers,
and the host version of SGLang's Triton KV-index kernel (:func:`host_kv_indices`). Made before KV sizing, as SGLang
makes its memory pools (``flashinfer.py``'s adapter).
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Iterator

from pytest_kvprofile.contract.protocol import Batch
from pytest_kvprofile.engines.adapter import Patches
from pytest_kvprofile.engines.batches import pad_to_capture, runner_batch
from pytest_kvprofile.engines.sglang.case_config import SglangEngine, SglangValue

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case



# -- the runner ---------------------------------------------------------------------------------------------------

class HostKvIndices:
    """SGLang's ``create_flashinfer_kv_indices_triton[grid](req_to_token, req_pool_indices, page_kernel_lens,
    kv_indptr, kv_start_idx, kv_indices, stride, ENTRY_PAGE_SIZE=, TOKEN_BLOCK_PARALLEL=, token_mapping=)`` (a Triton
    kernel) done on the host: lane ``b``'s ids ``[start_b, start_b + len_b)`` of its ``req_to_token`` row go to
    ``kv_indices[kv_indptr[b]:]``, a page-granular source expanded to tokens, mapped through ``token_mapping``."""

    def __getitem__(self, grid: SglangValue) -> SglangValue:
        return self._launch

    @staticmethod
    def _launch(req_to_token: SglangValue, req_pool_indices: SglangValue, page_kernel_lens: SglangValue,
                kv_indptr: SglangValue, kv_start_idx: SglangValue,
                kv_indices: SglangValue, stride: int, ENTRY_PAGE_SIZE: int = 1, TOKEN_BLOCK_PARALLEL: bool = False,  # noqa: N803
                token_mapping: SglangValue = None) -> None:
        import numpy as np

        lens = page_kernel_lens.numpy().astype(np.int64)
        bs = len(lens)
        if not bs:
            return
        rows = req_pool_indices.numpy()[:bs].astype(np.int64)
        starts = (kv_start_idx.numpy()[:bs].astype(np.int64) if kv_start_idx is not None
                  else np.zeros(bs, dtype=np.int64))
        offsets = kv_indptr.numpy()[:bs].astype(np.int64)
        table = req_to_token.reshape(-1).numpy()
        out = kv_indices.numpy()
        mapping = token_mapping.numpy() if token_mapping is not None else None
        page = int(ENTRY_PAGE_SIZE)
        for b in range(bs):
            n = int(lens[b])
            if n <= 0:
                continue
            pos = np.arange(starts[b], starts[b] + n, dtype=np.int64)
            ids = table[rows[b] * stride + pos // page].astype(np.int64)
            if page > 1:
                ids = ids * page + pos % page
            if mapping is not None:
                ids = np.where(ids >= 0, mapping[np.maximum(ids, 0)], ids)
            out[offsets[b]:offsets[b] + n] = ids


@contextlib.contextmanager
def host_kv_indices() -> Iterator[None]:
    """SGLang's KV index translator packs its CSR read stream with :class:`HostKvIndices` for the block."""
    import sglang.srt.mem_cache.kv_index_translator as translator

    patches = Patches()
    patches.set(translator, "create_flashinfer_kv_indices_triton", HostKvIndices())
    try:
        yield
    finally:
        patches.undo()


class _KvPoolStandin:
    """What SGLang's attention backend and index translator read of the KV pool: its KV quantization method (an
    unquantized or FP8 cache has none of its own: SGLang's ``UnquantizedKVCacheMethod``). The harness owns the KV
    cache itself, so no buffer is made here."""

    def __init__(self, quant_method: SglangValue, dtype: SglangValue, size: int) -> None:
        self.quant_method = quant_method
        self.dtype = dtype
        self.size = size

    def get_kv_cache_quant_method(self) -> SglangValue:
        return self.quant_method


class _AllocatorStandin:
    """SGLang's token-to-KV allocator as the backend reads it: its KV cache."""

    def __init__(self, kvcache: SglangValue, page_size: int) -> None:
        self._kvcache = kvcache
        self.page_size = page_size

    def get_kvcache(self) -> SglangValue:
        return self._kvcache


class _ModelStandin:
    """The runner's model as SGLang's attention backends read it: its modules (``TRTLLMHAAttnBackend`` looks for
    encoder-only attention layers; a plain decoder has none) and layers (an FP4 cache's method reads calibrated KV
    scales from them: none, so SGLang's neutral scales)."""

    layers: tuple[SglangValue, ...] = ()

    def modules(self) -> Iterator[SglangValue]:
        return iter(())


class SglangRunner:
    """SGLang's ``ModelRunner`` as its attention backend reads it: the request pool (SGLang's ``ReqToTokenPool``), the
    KV pool stand-in, SGLang's ``KVIndexTranslator``, its model config and dtypes, and the runner's capture-stable
    input buffers (``req_pool_indices``, ``seq_lens``, ``out_cache_loc``, ``positions``), made once, before KV
    sizing (SGLang makes its pools with the KV cache)."""

    def __init__(self, case: Case, engine: SglangEngine) -> None:
        import torch
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import UnquantizedKVCacheMethod
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        env = case.envelope
        self.case = case
        self.server_args = engine.server_args
        self.model_config = engine.model_config
        self.device = "cuda"
        self.gpu_id = 0
        self.dtype = engine.dtype
        self.kv_cache_dtype = engine.kv_cache_dtype
        self.kv_cache_dtype_str = engine.kv_cache_dtype_str
        self.page_size = engine.page_size  # SGLang's resolved one (trtllm_mla raises 16 to 64)
        self.sliding_window_size = None
        self.is_draft_worker = False
        self.use_mla_backend = case.model.attention == "mla"
        self.spec_algorithm = SpeculativeAlgorithm.from_string(engine.server_args.speculative_algorithm)
        self.draft_attention_backend = None  # --speculative-draft-attention-backend: the target's
        self.prefill_attention_backend_str = engine.attention_backend
        self.decode_attention_backend_str = engine.attention_backend
        self.max_running_requests = env.max_num_seqs
        self.model = _ModelStandin()
        self.req_to_token_pool = ReqToTokenPool(size=env.max_num_seqs, max_context_len=engine.model_config.context_len,
                                                device="cuda", enable_memory_saver=False)
        self.token_to_kv_pool = _KvPoolStandin(self._kv_quant_method(engine) or UnquantizedKVCacheMethod(),
                                               engine.kv_cache_dtype, 0)
        self.token_to_kv_pool_allocator = _AllocatorStandin(self.token_to_kv_pool, self.page_size)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=self.page_size, device="cuda")
        q = 1 + case.mtp  # SGLang's captured_req_width
        max_bs = max(engine.capture_bs, default=1)
        tokens = max(env.max_num_batched_tokens, max_bs * q)
        reqs = env.max_num_seqs
        # the verify graphs' custom mask (base_runner.py: (max_bs x seq_len_fill_value + max_num_token) x width)
        self.verify_mask = (torch.ones((max_bs + max_bs * q) * q, dtype=torch.bool, device="cuda") if case.mtp
                            else None)
        self.req_pool_indices = torch.zeros(reqs, dtype=torch.int64, device="cuda")
        self.seq_lens = torch.ones(reqs, dtype=torch.int64, device="cuda")
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device="cuda")
        self.positions = torch.zeros(tokens, dtype=torch.int64, device="cuda")
        self.prefix_lens = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.extend_lens = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.num_correct_drafts = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.num_accept_tokens = torch.zeros(reqs, dtype=torch.int32, device="cuda")

    def _kv_quant_method(self, engine: SglangEngine) -> SglangValue:
        """SGLang's KV quantization method of an FP4 cache, made as its KV-cache configurator makes it
        (``_build_fp4_quant_method``: the recipe from ``--kv-cache-dtype``, one global scale per layer, the attention
        accesses of the resolved backends, the model's scales: none here, SGLang's neutral 1.0); None for any
        other cache (SGLang's ``UnquantizedKVCacheMethod``)."""
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
            get_kv_cache_quant_method,
            resolve_kv_cache_quant,
        )

        name = resolve_kv_cache_quant(engine.kv_cache_dtype_str)
        if name is None:
            return None
        method = get_kv_cache_quant_method(name, num_layers=self.case.model.num_layers, device="cuda",
                                           page_size=self.page_size)
        method.configure_attention_backends_from_server_args(engine.server_args)
        method.load_scales_from_model(self)
        return method

    def draft_runner(self) -> SglangRunner:
        """The draft worker's model runner as its backends read it: SGLang's draft runner shares the target's
        request pool and token allocator (the index translator over them, as the harness owns both KV caches) and
        is a draft worker."""
        draft = copy.copy(self)
        draft.is_draft_worker = True
        return draft

    def forward_batch(self, batch: Batch, capture_bs: list[int], *, graph: bool, capture: bool,
                      draft: bool = False) -> SglangValue:
        """The batch as SGLang's ``ForwardBatch`` on the runner's buffers, with its ``KVLocPlan``: request ``i`` on
        request-pool row ``i + 1`` (row 0 is SGLang's padding row), every request at the envelope's full context
        (``engines/batches.py``). A captured decode size is SGLang's dummy capture batch: rows 0, lengths of
        the backend's fill value.

        With MTP a decode step is SGLang's speculative step: on the target worker ``TARGET_VERIFY`` of the
        ``1 + mtp`` tokens of every request (an ``EagleVerifyInput`` with its tree mask; the lengths are the committed
        prefix), on the draft worker (``draft``) ``DRAFT_EXTEND_V2`` of the same window (an ``EagleDraftExtendInput``;
        the lengths include the window). A prefill or mixed step is an extend on either worker."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        case = self.case
        q = 1 + case.mtp
        if graph:
            batch = pad_to_capture(batch, [bs * q for bs in capture_bs], case.mtp)
        rb = runner_batch(case, batch, case.envelope.max_num_seqs)
        bs, tokens = rb.num_reqs, rb.num_tokens
        speculative = bool(case.mtp) and batch.kind == "decode"
        verify = speculative and not draft
        if capture:
            self.req_pool_indices[:bs].zero_()
            self.seq_lens[:bs].fill_(1)
            seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
        else:
            # a verify step's lengths are the committed prefix: the window is appended by SGLang's verify input
            seq_lens_cpu = torch.tensor(rb.seq_lens, dtype=torch.int64) - (q if verify else 0)
            self.req_pool_indices[:bs].copy_(torch.arange(1, bs + 1, dtype=torch.int64))
            self.seq_lens[:bs].copy_(seq_lens_cpu)
        mode = {"decode": ForwardMode.DECODE, "prefill": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[batch.kind]
        if speculative:
            mode = ForwardMode.DRAFT_EXTEND_V2 if draft else ForwardMode.TARGET_VERIFY
        values: dict[str, SglangValue] = dict(
            forward_mode=mode, batch_size=bs, input_ids=self.positions[:tokens], req_pool_indices=
            self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs], seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc[:tokens], seq_lens_sum=int(seq_lens_cpu.sum()),
            positions=self.positions[:tokens], orig_seq_lens=self.seq_lens[:bs], spec_algorithm=self.spec_algorithm,
            can_run_decode_cuda_graph=graph, global_forward_mode=mode)
        if mode != ForwardMode.DECODE and not verify:
            extend = torch.tensor(rb.query_lens, dtype=torch.int32)
            prefix = (seq_lens_cpu.to(torch.int32) - extend).clamp(min=0)
            self.prefix_lens[:bs].copy_(prefix)
            self.extend_lens[:bs].copy_(extend)
            values.update(extend_num_tokens=tokens, extend_seq_lens=self.extend_lens[:bs],
                          extend_prefix_lens=self.prefix_lens[:bs], extend_prefix_lens_cpu=prefix.tolist(),
                          extend_seq_lens_cpu=extend.tolist())
        if verify:
            values["spec_info"] = self._verify_input(seq_lens_cpu, capture)
        elif speculative:
            values["spec_info"] = self._draft_extend_input(bs)
        forward_batch = ForwardBatch(**values)
        if capture:
            self.kv_index_translator.bind_runner_slots(forward_batch)
        else:
            self.kv_index_translator.own_plan(forward_batch).bind(forward_batch, self.kv_index_translator)
        return forward_batch

    def _verify_input(self, seq_lens_cpu: SglangValue, capture: bool) -> SglangValue:
        """SGLang's ``EagleVerifyInput`` of a verify step: a capture reads the graph runner's mask buffer (its
        ``get_spec_info``); a served step carries the tree mask its draft built (every prefix token, then the
        window's own ``(1 + mtp)^2``)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        q = 1 + self.case.mtp
        bs = len(seq_lens_cpu)
        mask = (self.verify_mask if capture else
                torch.ones(int(seq_lens_cpu.sum()) * q + q * q * bs, dtype=torch.bool, device="cuda"))
        return EagleVerifyInput(
            draft_token=None, custom_mask=mask, positions=None, retrieve_index=None, retrieve_next_token=None,
            retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=self.case.mtp, topk=1, draft_token_num=q,
            capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None, seq_lens_cpu=None)

    def _draft_extend_input(self, bs: int) -> SglangValue:
        """SGLang's ``EagleDraftExtendInput`` of a draft-extend step over the whole window (every draft token
        accepted: the longest extend)."""
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

        q = 1 + self.case.mtp
        self.num_correct_drafts[:bs].fill_(q - 1)
        self.num_accept_tokens[:bs].fill_(q)
        return EagleDraftExtendInput(num_correct_drafts=self.num_correct_drafts[:bs],
                                     num_accept_tokens=self.num_accept_tokens[:bs], num_tokens_per_req=q,
                                     num_tokens_for_logprob_per_req=1)

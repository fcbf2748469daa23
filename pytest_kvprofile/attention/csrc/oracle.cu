// Host-only oracle: FlashInfer's own workspace planners, compiled for the CPU.
//
// Everything here runs on the host. The CUDA runtime calls the planners make are satisfied by
// cuda_stubs.cpp (a separate host-only translation unit), so the library links without libcudart
// and the SM count / compute capability are whatever the caller sets through kvp_set_device().
//
// Build-time switches, read by oracle_build.py from the text of the scheduler.cuh it compiles against (one
// generation of FlashInfer's planner signatures each; a wrong switch fails the build, never the arithmetic):
//   KVP_HAS_COUNT_ONLY       PrefillPlanWorkspaceSize / DecodePlanWorkspaceSize exist (>= 0.6.15)
//   KVP_HAS_UNIFORM_Q        PrefillPlan takes uniform_q_len after num_colocated_ctas (>= 0.6.16)
//   KVP_HAS_FIXED_UNIFORM_Q  ... and fixed_uniform_q_len after it (>= 0.7.4)
//   KVP_HAS_KV_DTYPE_BYTES   PrefillPlan takes a trailing kv_dtype_bytes (sizeof(DTypeKV), as the JIT module passes
//                            it; >= 0.6.18); without it the planner assumes 2 bytes, and so does this library
// Every generation takes num_colocated_ctas (0 here: no POD co-scheduling).
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <flashinfer/attention/scheduler.cuh>

#ifndef KVP_HAS_COUNT_ONLY
#define KVP_HAS_COUNT_ONLY 1
#endif
#ifndef KVP_HAS_UNIFORM_Q
#define KVP_HAS_UNIFORM_Q 1
#endif
#ifndef KVP_HAS_FIXED_UNIFORM_Q
#define KVP_HAS_FIXED_UNIFORM_Q KVP_HAS_UNIFORM_Q
#endif
#ifndef KVP_HAS_KV_DTYPE_BYTES
#define KVP_HAS_KV_DTYPE_BYTES KVP_HAS_UNIFORM_Q
#endif

// The planner arguments after num_colocated_ctas that only some generations have.
#if KVP_HAS_FIXED_UNIFORM_Q
#define KVP_UNIFORM_ARGS(u, fixed) , (u), (fixed)
#elif KVP_HAS_UNIFORM_Q
#define KVP_UNIFORM_ARGS(u, fixed) , (u)
#else
#define KVP_UNIFORM_ARGS(u, fixed)
#endif

extern "C" void kvp_stub_set_device(int num_sm, int cc_major, int cc_minor, int smem_optin);

#if KVP_HAS_KV_DTYPE_BYTES
#define KVP_KV_BYTES , static_cast<uint32_t>(kv_dtype_bytes)
#else
#define KVP_KV_BYTES
#endif

namespace {

thread_local std::string g_last_error;

int fail(const std::string& msg) {
  g_last_error = msg;
  return 1;
}

// The planner reads IdType (and, up to 0.6.14, names DTypeO without using its size); bf16-sized types.
struct HostDecodeParams {
  using IdType = int32_t;
  using DTypeQ = uint16_t;
  using DTypeKV = uint16_t;
  using DTypeO = uint16_t;
};

// The 16-byte-aligned bump allocator only ever advances; offsets of the last two carvings plus
// their sizes give the bytes a materializing plan used.
size_t end_of(size_t offset, size_t size) { return offset + size; }

void* const kFakeFloatBase = reinterpret_cast<void*>(uintptr_t(1) << 20);

}  // namespace

extern "C" {

const char* kvp_last_error() { return g_last_error.c_str(); }

int kvp_abi_version() { return 2; }

void kvp_set_device(int num_sm, int cc_major, int cc_minor, int smem_optin) {
  kvp_stub_set_device(num_sm, cc_major, cc_minor, smem_optin);
}

// FA2 prefill planner (also the tensor-core decode planner, with uniform_q_len > 0).
// kv_indptr counts pages, as FlashInfer's paged wrappers pass it. materialize != 0 runs the
// materializing PrefillPlan on caller-provided host buffers and reads the carved extents back.
int kvp_prefill_plan_size(const int32_t* qo_indptr, const int32_t* kv_indptr, int batch_size,
                          int num_qo_heads, int num_kv_heads, int head_dim_qk, int head_dim_vo,
                          int page_size, int enable_cuda_graph, int window_left,
                          int fixed_split_size, int disable_split_kv, int64_t uniform_q_len,
                          int fixed_uniform_q_len, int materialize, void* float_buf,
                          uint64_t float_buf_size, void* int_buf, uint64_t int_buf_size,
                          uint64_t* float_bytes, uint64_t* int_bytes, int64_t* info15,
                          int kv_dtype_bytes) {
  try {
#if !KVP_HAS_KV_DTYPE_BYTES
    (void)kv_dtype_bytes;
#endif
#if !KVP_HAS_UNIFORM_Q
    (void)uniform_q_len;
#endif
#if !KVP_HAS_FIXED_UNIFORM_Q
    (void)fixed_uniform_q_len;
#endif
    std::vector<int32_t> qo(qo_indptr, qo_indptr + batch_size + 1);
    std::vector<int32_t> kv(kv_indptr, kv_indptr + batch_size + 1);
    const uint32_t total_num_rows = static_cast<uint32_t>(qo[batch_size]);
    size_t fbytes = 0, ibytes = 0;
    flashinfer::PrefillPlanInfo info;
    cudaError_t st;
    if (!materialize) {
#if KVP_HAS_COUNT_ONLY
      st = flashinfer::PrefillPlanWorkspaceSize<int32_t>(
          fbytes, ibytes, qo.data(), kv.data(), total_num_rows, batch_size, num_qo_heads,
          num_kv_heads, head_dim_qk, head_dim_vo, page_size, enable_cuda_graph != 0,
          /*sizeof_dtype_o=*/2, window_left, fixed_split_size, disable_split_kv != 0,
          /*num_colocated_ctas=*/0 KVP_UNIFORM_ARGS(uniform_q_len, fixed_uniform_q_len != 0),
          nullptr KVP_KV_BYTES);
      if (st != cudaSuccess) return fail("PrefillPlanWorkspaceSize returned a CUDA error");
#else
      return fail("this FlashInfer has no PrefillPlanWorkspaceSize; use materialize=1");
#endif
    } else {
      // The float buffer is only carved, never written: a fake aligned base with the caller's
      // capacity measures it without allocating gigabytes.
      if (float_buf == nullptr) float_buf = kFakeFloatBase;
      // The pinned host mirror and the device int buffer are the same host memory here: the
      // stubbed cudaMemcpyAsync is a no-op when source and destination coincide.
      st = flashinfer::PrefillPlan<int32_t>(
          float_buf, float_buf_size, int_buf, int_buf, int_buf_size, info, qo.data(), kv.data(),
          total_num_rows, batch_size, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
          page_size, enable_cuda_graph != 0, 2, window_left, fixed_split_size,
          disable_split_kv != 0, /*num_colocated_ctas=*/0
          KVP_UNIFORM_ARGS(uniform_q_len, fixed_uniform_q_len != 0), nullptr KVP_KV_BYTES);
      if (st != cudaSuccess) return fail("PrefillPlan returned a CUDA error");
      if (info.split_kv) {
        // tmp_v starts at offset 0 and tmp_s follows it; tmp_s is tmp_v / head_dim_vo bytes.
        const size_t tmp_v = info.s_offset;
        fbytes = end_of(info.s_offset, tmp_v / static_cast<size_t>(head_dim_vo));
      }
      size_t iend = end_of(info.kv_chunk_size_ptr_offset, sizeof(int32_t));
      iend = std::max(iend, end_of(info.o_indptr_offset, sizeof(int32_t) * (batch_size + 1)));
      if (info.enable_cuda_graph) {
        iend = std::max(iend, end_of(info.total_num_rows_offset, sizeof(uint32_t)));
        iend = std::max(iend, end_of(info.block_valid_mask_offset,
                                     sizeof(bool) * static_cast<size_t>(info.padded_batch_size)));
      }
      if (info.split_kv) {
        iend = std::max(iend, end_of(info.merge_indptr_offset,
                                     sizeof(int32_t) * static_cast<size_t>(total_num_rows + 1)));
        if (!info.enable_cuda_graph) {
          iend = std::max(iend, end_of(info.block_valid_mask_offset, 0));
        }
      }
      ibytes = iend;
    }
    *float_bytes = fbytes;
    *int_bytes = ibytes;
    if (info15) {
      std::vector<int64_t> v = info.ToVector();
      for (size_t i = 0; i < v.size() && i < 15; ++i) info15[i] = v[i];
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception in the prefill planner");
  }
}

}  // extern "C"

namespace {

// Host model of BatchDecodeWithPagedKVCacheWorkEstimationDispatched: the real one asks the driver
// for the decode kernel's occupancy; here blocks_per_sm is an input, everything else is the same.
struct HostDecodeWorkEstimation {
  uint32_t num_kv_heads;
  uint32_t blocks_per_sm;
  uint32_t num_sm;
  cudaError_t operator()(bool& split_kv, uint32_t& max_grid_size,
                         uint32_t& max_num_pages_per_batch, uint32_t& new_batch_size,
                         uint32_t& gdy, uint32_t batch_size, int32_t* kv_indptr_h,
                         const uint32_t num_qo_heads, const uint32_t page_size,
                         bool enable_cuda_graph, cudaStream_t) const {
    (void)num_qo_heads;
    gdy = num_kv_heads;
    max_grid_size = blocks_per_sm * num_sm;
    if (batch_size * gdy >= max_grid_size) {
      split_kv = false;
      max_num_pages_per_batch = 1;
      for (uint32_t b = 0; b < batch_size; ++b) {
        max_num_pages_per_batch =
            std::max<uint32_t>(max_num_pages_per_batch, kv_indptr_h[b + 1] - kv_indptr_h[b]);
      }
      new_batch_size = batch_size;
    } else {
      std::vector<int32_t> num_pages(batch_size);
      for (uint32_t b = 0; b < batch_size; ++b) num_pages[b] = kv_indptr_h[b + 1] - kv_indptr_h[b];
      std::tie(max_num_pages_per_batch, new_batch_size) =
          flashinfer::PartitionPagedKVCacheBinarySearchMinNumPagePerBatch(
              max_grid_size, gdy, num_pages, std::max(128 / page_size, 1U));
      split_kv = !(new_batch_size == batch_size && !enable_cuda_graph);
    }
    return cudaSuccess;
  }
};

template <uint32_t HEAD_DIM>
cudaError_t decode_size(size_t& f, size_t& i, int32_t* indptr, uint32_t batch_size,
                        uint32_t num_qo_heads, uint32_t page_size, bool cuda_graph,
                        HostDecodeWorkEstimation est, int materialize, void* float_buf,
                        uint64_t float_buf_size, void* int_buf, uint64_t int_buf_size,
                        flashinfer::DecodePlanInfo& info) {
  using flashinfer::PosEncodingMode;
  if (float_buf == nullptr) float_buf = kFakeFloatBase;
  if (!materialize) {
#if KVP_HAS_COUNT_ONLY
    return flashinfer::DecodePlanWorkspaceSize<HEAD_DIM, PosEncodingMode::kNone, void,
                                               HostDecodeParams>(
        f, i, indptr, batch_size, num_qo_heads, page_size, cuda_graph, nullptr, est);
#else
    throw std::runtime_error("this FlashInfer has no DecodePlanWorkspaceSize; use materialize=1");
#endif
  }
  cudaError_t st =
      flashinfer::DecodePlan<HEAD_DIM, PosEncodingMode::kNone, void, HostDecodeParams>(
          float_buf, float_buf_size, int_buf, int_buf, int_buf_size, info, indptr, batch_size,
          num_qo_heads, page_size, cuda_graph, nullptr, est);
  f = info.split_kv ? end_of(info.s_offset, sizeof(float) * num_qo_heads * info.padded_batch_size)
                    : 0;
  size_t iend = end_of(info.kv_chunk_size_ptr_offset, sizeof(int32_t));
  if (info.split_kv) {
    iend = std::max(iend, end_of(info.block_valid_mask_offset, info.padded_batch_size));
  }
  i = iend;
  return st;
}

}  // namespace

extern "C" {

// CUDA-core decode planner (BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores=False).
int kvp_decode_plan_size(const int32_t* kv_indptr, int batch_size, int num_qo_heads,
                         int num_kv_heads, int head_dim, int page_size, int enable_cuda_graph,
                         int blocks_per_sm, int num_sm, int materialize, void* float_buf,
                         uint64_t float_buf_size, void* int_buf, uint64_t int_buf_size,
                         uint64_t* float_bytes, uint64_t* int_bytes, int64_t* padded_out) {
  try {
    if (num_kv_heads <= 0 || num_qo_heads % num_kv_heads) {
      return fail("num_qo_heads must be a positive multiple of num_kv_heads");
    }
    std::vector<int32_t> kv(kv_indptr, kv_indptr + batch_size + 1);
    HostDecodeWorkEstimation est{static_cast<uint32_t>(num_kv_heads),
                                 static_cast<uint32_t>(blocks_per_sm),
                                 static_cast<uint32_t>(num_sm)};
    size_t f = 0, i = 0;
    flashinfer::DecodePlanInfo info;
    cudaError_t st;
#define KVP_DECODE_CASE(D)                                                                     \
  case D:                                                                                      \
    st = decode_size<D>(f, i, kv.data(), batch_size, num_qo_heads, page_size,                  \
                        enable_cuda_graph != 0, est, materialize, float_buf, float_buf_size,   \
                        int_buf, int_buf_size, info);                                          \
    break;
    switch (head_dim) {
      KVP_DECODE_CASE(64)
      KVP_DECODE_CASE(96)
      KVP_DECODE_CASE(128)
      KVP_DECODE_CASE(192)
      KVP_DECODE_CASE(256)
      KVP_DECODE_CASE(512)
      default:
        return fail("CUDA-core decode head_dim must be one of 64, 96, 128, 192, 256, 512");
    }
#undef KVP_DECODE_CASE
    if (st != cudaSuccess) return fail("DecodePlan returned a CUDA error");
    *float_bytes = f;
    *int_bytes = i;
    if (padded_out) *padded_out = info.padded_batch_size;
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception in the decode planner");
  }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Host plan(): the materializing planners on real host buffers, as FlashInfer's JIT plan()
// functions call them (batch_prefill.cu BatchPrefillWithKVCachePlan, batch_decode.cu
// BatchDecodeWithPagedKVCachePlan), for the simulated device's wrappers (attention/host_plan.py).
// The device the planners see is set for the call and the previous one restored, so the sizing
// oracle sharing this library keeps its own.

extern "C" void kvp_stub_get_device(int* out4);

namespace {

struct DeviceScope {
  int saved[4];
  DeviceScope(int num_sm, int cc_major, int cc_minor, int smem_optin) {
    kvp_stub_get_device(saved);
    kvp_stub_set_device(num_sm, cc_major, cc_minor, smem_optin);
  }
  ~DeviceScope() { kvp_stub_set_device(saved[0], saved[1], saved[2], saved[3]); }
};

int copy_info(const std::vector<int64_t>& v, int64_t* info_out, int info_cap, int* info_len) {
  *info_len = static_cast<int>(v.size());
  if (static_cast<int>(v.size()) > info_cap) return fail("plan info longer than the caller's buffer");
  for (size_t k = 0; k < v.size(); ++k) info_out[k] = v[k];
  return 0;
}

}  // namespace

extern "C" {

int kvp_host_prefill_plan(void* float_buf, uint64_t float_size, void* int_buf, void* pinned_buf,
                          uint64_t int_size, const int32_t* qo_indptr, const int32_t* kv_indptr,
                          int64_t total_num_rows, int64_t batch_size, int64_t num_qo_heads,
                          int64_t num_kv_heads, int64_t page_size, int enable_cuda_graph,
                          int64_t head_dim_qk, int64_t head_dim_vo, int64_t window_left,
                          int64_t fixed_split_size, int disable_split_kv, int64_t num_colocated_ctas,
                          int64_t uniform_q_len, int fixed_uniform_q_len, int num_sm, int cc_major,
                          int cc_minor, int smem_optin, int64_t* info_out, int info_cap,
                          int* info_len, int kv_dtype_bytes) {
  try {
#if !KVP_HAS_KV_DTYPE_BYTES
    (void)kv_dtype_bytes;
#endif
    DeviceScope scope(num_sm, cc_major, cc_minor, smem_optin);
    std::vector<int32_t> qo(qo_indptr, qo_indptr + batch_size + 1);
    std::vector<int32_t> kv(kv_indptr, kv_indptr + batch_size + 1);
    flashinfer::PrefillPlanInfo info;
    cudaError_t st = flashinfer::PrefillPlan<int32_t>(
        float_buf, float_size, int_buf, pinned_buf, int_size, info, qo.data(), kv.data(),
        static_cast<uint32_t>(total_num_rows), static_cast<uint32_t>(batch_size), num_qo_heads,
        num_kv_heads, head_dim_qk, head_dim_vo, page_size, enable_cuda_graph != 0, 2, window_left,
        fixed_split_size, disable_split_kv != 0, num_colocated_ctas
        KVP_UNIFORM_ARGS(uniform_q_len, fixed_uniform_q_len != 0), nullptr KVP_KV_BYTES);
#if !KVP_HAS_UNIFORM_Q
    (void)uniform_q_len;
#endif
#if !KVP_HAS_FIXED_UNIFORM_Q
    (void)fixed_uniform_q_len;
#endif
    if (st != cudaSuccess) return fail("Failed to plan prefill with error: PrefillPlan returned a CUDA error");
    return copy_info(info.ToVector(), info_out, info_cap, info_len);
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception in the prefill planner");
  }
}

int kvp_host_decode_plan(void* float_buf, uint64_t float_size, void* int_buf, void* pinned_buf,
                         uint64_t int_size, const int32_t* indptr, int64_t batch_size,
                         int64_t num_qo_heads, int64_t num_kv_heads, int64_t page_size,
                         int enable_cuda_graph, int64_t head_dim, int blocks_per_sm, int num_sm,
                         int cc_major, int cc_minor, int smem_optin, int64_t* info_out,
                         int info_cap, int* info_len) {
  try {
    if (num_kv_heads <= 0 || num_qo_heads % num_kv_heads) {
      return fail("num_qo_heads must be a positive multiple of num_kv_heads");
    }
    DeviceScope scope(num_sm, cc_major, cc_minor, smem_optin);
    std::vector<int32_t> kv(indptr, indptr + batch_size + 1);
    HostDecodeWorkEstimation est{static_cast<uint32_t>(num_kv_heads),
                                 static_cast<uint32_t>(blocks_per_sm),
                                 static_cast<uint32_t>(num_sm)};
    flashinfer::DecodePlanInfo info;
    cudaError_t st = cudaSuccess;
    using flashinfer::PosEncodingMode;
#define KVP_HOST_DECODE_CASE(D)                                                                \
  case D:                                                                                      \
    st = flashinfer::DecodePlan<D, PosEncodingMode::kNone, void, HostDecodeParams>(            \
        float_buf, float_size, int_buf, pinned_buf, int_size, info, kv.data(),                 \
        static_cast<uint32_t>(batch_size), static_cast<uint32_t>(num_qo_heads),                \
        static_cast<uint32_t>(page_size), enable_cuda_graph != 0, nullptr, est);               \
    break;
    switch (head_dim) {
      KVP_HOST_DECODE_CASE(64)
      KVP_HOST_DECODE_CASE(96)
      KVP_HOST_DECODE_CASE(128)
      KVP_HOST_DECODE_CASE(192)
      KVP_HOST_DECODE_CASE(256)
      KVP_HOST_DECODE_CASE(512)
      default:
        return fail("CUDA-core decode head_dim must be one of 64, 96, 128, 192, 256, 512");
    }
#undef KVP_HOST_DECODE_CASE
    if (st != cudaSuccess) return fail("BatchDecodeWithPagedKVCache failed with error: DecodePlan returned a CUDA error");
    return copy_info(info.ToVector(), info_out, info_cap, info_len);
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception in the decode planner");
  }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Host plan() of the MLA wrapper's generated FA backends: MLAPlan as batch_mla_plan.cu
// (BatchMLAPagedAttentionPlan) calls it. FlashInfer >= 0.7 returns the bytes of the page-locked
// buffer the caller must stage into the int buffer (its Python adapter copies them); earlier
// versions copy them themselves (cudaMemcpyAsync, a memmove in the stub runtime) and stage 0 here.
// Which signature the installed headers have is detected at compile time, so either builds.

#include <type_traits>
#include <utility>

namespace {

template <typename IdType, typename = void>
struct MLAPlanReportsStaged : std::false_type {};

template <typename IdType>
struct MLAPlanReportsStaged<
    IdType, std::void_t<decltype(flashinfer::MLAPlan<IdType>(
                nullptr, size_t(0), nullptr, nullptr, size_t(0),
                std::declval<flashinfer::MLAPlanInfo&>(), std::declval<size_t&>(),
                static_cast<IdType*>(nullptr), static_cast<IdType*>(nullptr),
                static_cast<IdType*>(nullptr), 0u, 0u, 0u, false, cudaStream_t(nullptr)))>>
    : std::true_type {};

template <typename IdType>
cudaError_t host_mla_plan(void* float_buf, size_t float_size, void* int_buf, void* pinned_buf,
                          size_t int_size, flashinfer::MLAPlanInfo& info, size_t& staged,
                          IdType* qo, IdType* kv, IdType* lens, uint32_t batch_size,
                          uint32_t num_heads, uint32_t head_dim_o, bool causal) {
  if constexpr (MLAPlanReportsStaged<IdType>::value) {
    return flashinfer::MLAPlan<IdType>(float_buf, float_size, int_buf, pinned_buf, int_size, info,
                                       staged, qo, kv, lens, batch_size, num_heads, head_dim_o,
                                       causal, nullptr);
  } else {
    staged = 0;
    return flashinfer::MLAPlan<IdType>(float_buf, float_size, int_buf, pinned_buf, int_size, info,
                                       qo, kv, lens, batch_size, num_heads, head_dim_o, causal,
                                       nullptr);
  }
}

}  // namespace

extern "C" {

int kvp_host_mla_plan(void* float_buf, uint64_t float_size, void* int_buf, void* pinned_buf,
                      uint64_t int_size, const int32_t* qo_indptr, const int32_t* kv_indptr,
                      const int32_t* kv_len, int64_t batch_size, int64_t num_heads,
                      int64_t head_dim_o, int causal, int num_sm, int cc_major, int cc_minor,
                      int smem_optin, int64_t* info_out, int info_cap, int* info_len,
                      uint64_t* staged_int_bytes) {
  try {
    if (batch_size <= 0) return fail("MLA plan needs a nonempty batch");
    DeviceScope scope(num_sm, cc_major, cc_minor, smem_optin);
    std::vector<int32_t> qo(qo_indptr, qo_indptr + batch_size + 1);
    std::vector<int32_t> kv(kv_indptr, kv_indptr + batch_size + 1);
    std::vector<int32_t> lens(kv_len, kv_len + batch_size);
    flashinfer::MLAPlanInfo info;
    size_t staged = 0;
    cudaError_t st = host_mla_plan<int32_t>(
        float_buf, float_size, int_buf, pinned_buf, int_size, info, staged, qo.data(), kv.data(),
        lens.data(), static_cast<uint32_t>(batch_size), static_cast<uint32_t>(num_heads),
        static_cast<uint32_t>(head_dim_o), causal != 0);
    if (st != cudaSuccess) return fail("Failed to plan MLA, error: MLAPlan returned a CUDA error");
    *staged_int_bytes = staged;
    return copy_info(info.ToVector(), info_out, info_cap, info_len);
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception in the MLA planner");
  }
}

}  // extern "C"

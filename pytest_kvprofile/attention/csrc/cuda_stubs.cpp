// Host-only stand-ins for the CUDA runtime symbols the planners and nvcc's generated host code
// reference. Compiled as plain C++ so the oracle library never needs libcudart or a GPU.
//
// Every symbol here is hidden: the library's own references bind to these definitions at link
// time (with -Bsymbolic as a second guard), so a real libcudart loaded RTLD_GLOBAL before the
// oracle (a CUDA build of torch) neither answers cudaDeviceGetAttribute for it nor sees these.
#include <cstddef>
#include <cstdint>
#include <cstring>

#pragma GCC visibility push(hidden)

namespace {
int g_num_sm = 132;
int g_cc_major = 9;
int g_cc_minor = 0;
int g_smem_optin = 232448;
void* g_fatbin_handle[4] = {nullptr, nullptr, nullptr, nullptr};
}  // namespace

// Enum values follow cuda_runtime_api / driver_types; they are ABI-stable.
enum {
  kDevAttrMaxSharedMemoryPerBlockOptin = 97,
  kDevAttrMultiProcessorCount = 16,
  kDevAttrComputeCapabilityMajor = 75,
  kDevAttrComputeCapabilityMinor = 76,
};

extern "C" {

void kvp_stub_set_device(int num_sm, int cc_major, int cc_minor, int smem_optin) {
  g_num_sm = num_sm;
  g_cc_major = cc_major;
  g_cc_minor = cc_minor;
  g_smem_optin = smem_optin;
}

void kvp_stub_get_device(int* out4) {
  out4[0] = g_num_sm;
  out4[1] = g_cc_major;
  out4[2] = g_cc_minor;
  out4[3] = g_smem_optin;
}

int cudaGetDevice(int* device) {
  *device = 0;
  return 0;
}

int cudaDeviceGetAttribute(int* value, int attr, int) {
  switch (attr) {
    case kDevAttrMultiProcessorCount: *value = g_num_sm; return 0;
    case kDevAttrComputeCapabilityMajor: *value = g_cc_major; return 0;
    case kDevAttrComputeCapabilityMinor: *value = g_cc_minor; return 0;
    case kDevAttrMaxSharedMemoryPerBlockOptin: *value = g_smem_optin; return 0;
    default: *value = 0; return 1;  // cudaErrorInvalidValue: an attribute the oracle never models
  }
}

int cudaMemcpyAsync(void* dst, const void* src, size_t count, int, void*) {
  if (dst != src && count) std::memmove(dst, src, count);
  return 0;
}

const char* cudaGetErrorString(int) { return "stubbed CUDA runtime (pytest-kvprofile host oracle)"; }
int cudaGetLastError() { return 0; }
int cudaPeekAtLastError() { return 0; }

void** __cudaRegisterFatBinary(void*) { return g_fatbin_handle; }
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char*, char*, const char*, int, void*, void*, void*,
                            void*, int*) {}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}
void __cudaRegisterManagedVar(void**, void**, char*, const char*, int, size_t, int, int) {}
char __cudaInitModule(void**) { return 0; }
unsigned __cudaPushCallConfiguration(uint64_t, uint32_t, uint64_t, uint32_t, size_t, void*) {
  return 0;
}
int __cudaPopCallConfiguration(void*, void*, size_t*, void*) { return 0; }
int cudaLaunchKernel(const void*, uint64_t, uint32_t, uint64_t, uint32_t, void**, size_t, void*) {
  return 1;
}

}  // extern "C"

#pragma GCC visibility pop

#include "cuda_copy.hpp"

#include <mutex>
#include <stdexcept>

#ifdef OFFLOAD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace offload::cuda {

#ifdef OFFLOAD_WITH_CUDA

namespace {

struct Probe {
  bool usable = false;
  std::string reason;
};

const Probe& probe() {
  static Probe result;
  static std::once_flag once;
  std::call_once(once, [] {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      result.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
      cudaGetLastError();  // clear the sticky-free error so later calls start clean
    } else if (count == 0) {
      result.reason = "no CUDA device found";
    } else {
      result.usable = true;
    }
  });
  return result;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
}

void copy(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event,
          cudaMemcpyKind kind, const char* what) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                        kind, s),
        what);
  if (event != 0) check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), s), "cudaEventRecord");
}

}  // namespace

bool compiled() noexcept { return true; }
bool usable() noexcept {
  try {
    return probe().usable;
  } catch (...) {
    return false;
  }
}
std::string unusable_reason() { return probe().reason; }

void* host_alloc_pinned(size_t nbytes) {
  void* ptr = nullptr;
  // Portable: the arena serves every device of the process, not only the current one.
  check(cudaHostAlloc(&ptr, nbytes, cudaHostAllocPortable), "cudaHostAlloc");
  return ptr;
}

void host_free_pinned(void* ptr) noexcept { cudaFreeHost(ptr); }

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

int stream_device(uintptr_t stream) {
  if (stream == 0) return current_device();  // legacy default stream: the current device's
#if CUDART_VERSION >= 12080
  int device = 0;
  check(cudaStreamGetDevice(reinterpret_cast<cudaStream_t>(stream), &device),
        "cudaStreamGetDevice");
  return device;
#else
  return current_device();  // older runtimes cannot ask the stream; trust the caller's device
#endif
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

void copy_d2h(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event) {
  copy(dst, src, nbytes, stream, event, cudaMemcpyDeviceToHost, "cudaMemcpyAsync (device to host)");
}

void copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event) {
  copy(dst, src, nbytes, stream, event, cudaMemcpyHostToDevice, "cudaMemcpyAsync (host to device)");
}

void event_synchronize(uintptr_t event) {
  check(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void record_event(uintptr_t event, uintptr_t stream) {
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
}

void stream_synchronize_noexcept(uintptr_t stream) noexcept {
  cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
}

uintptr_t record_private_event(uintptr_t stream) {
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cudaError_t err = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    cudaEventDestroy(event);
    check(err, "cudaEventRecord");
  }
  return reinterpret_cast<uintptr_t>(event);
}

void destroy_event(uintptr_t event) noexcept {
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

#else  // built without the CUDA toolkit

namespace {
[[noreturn]] void unavailable(const char* what) {
  throw std::runtime_error(std::string(what) +
                           " needs CUDA, but offload._C was built without the CUDA toolkit "
                           "(reinstall with the toolkit present and OFFLOAD_BUILD_CUDA unset)");
}
}  // namespace

bool compiled() noexcept { return false; }
bool usable() noexcept { return false; }
std::string unusable_reason() { return "offload._C was built without the CUDA toolkit"; }
void* host_alloc_pinned(size_t) { unavailable("pinned host memory"); }
void host_free_pinned(void*) noexcept {}
int current_device() { unavailable("current_device"); }
int stream_device(uintptr_t) { unavailable("stream_device"); }
void set_device(int) { unavailable("set_device"); }
void copy_d2h(uintptr_t, uintptr_t, size_t, uintptr_t, uintptr_t) { unavailable("copy_d2h"); }
void copy_h2d(uintptr_t, uintptr_t, size_t, uintptr_t, uintptr_t) { unavailable("copy_h2d"); }
void event_synchronize(uintptr_t) { unavailable("event_synchronize"); }
void record_event(uintptr_t, uintptr_t) { unavailable("record_event"); }
void stream_synchronize_noexcept(uintptr_t) noexcept {}
uintptr_t record_private_event(uintptr_t) { unavailable("record_private_event"); }
void destroy_event(uintptr_t) noexcept {}

#endif

}  // namespace offload::cuda

#include "cuda_copy.hpp"

#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#ifdef OFFLOAD_WITH_CUDA
#include "cudart.hpp"
#endif

namespace offload::cuda {

#ifdef OFFLOAD_WITH_CUDA

namespace {

struct Probe {
  bool usable = false;
  std::string reason;
};

std::mutex g_probe_mu;
std::optional<Probe> g_probe;  // set once a runtime was found

Probe probe() {
  std::lock_guard<std::mutex> lock(g_probe_mu);
  if (g_probe) return *g_probe;
  std::string why;
  const cudart::Api* a = cudart::api(&why);
  if (a == nullptr) return Probe{false, why};  // not cached: see usable()
  Probe result;
  int count = 0;
  cudart::Error err = a->GetDeviceCount(&count);
  if (err != cudart::kSuccess) {
    result.reason = std::string("cudaGetDeviceCount failed: ") + a->GetErrorString(err) +
                    " (runtime " + a->path + ")";
    a->GetLastError();  // clear it, so torch's next error check does not report it as its own
  } else if (count == 0) {
    result.reason = "no CUDA device found";
  } else {
    result.usable = true;
  }
  g_probe = result;
  return result;
}

const cudart::Api& require(const char* what) {
  std::string why;
  const cudart::Api* a = cudart::api(&why);
  if (a == nullptr) throw std::runtime_error(std::string(what) + " needs CUDA, but " + why);
  return *a;
}

// The runtime torch uses keeps one "last error" per thread, which torch checks after its
// own launches: clear ours, so a failed call of ours is reported here, not there.
void check(const cudart::Api& a, cudart::Error err, const char* what) {
  if (err == cudart::kSuccess) return;
  a.GetLastError();
  throw std::runtime_error(std::string(what) + " failed: " + a.GetErrorString(err));
}

void copy(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event,
          cudart::MemcpyKind kind, const char* what) {
  const cudart::Api& a = require(what);
  auto s = reinterpret_cast<cudart::Stream>(stream);
  check(a, a.MemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes, kind, s),
        what);
  if (event != 0) check(a, a.EventRecord(reinterpret_cast<cudart::Event>(event), s), "cudaEventRecord");
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

RuntimeInfo runtime_info() {
  RuntimeInfo info;
  const cudart::Api* a = cudart::api(nullptr);
  if (a == nullptr) return info;
  info.path = a->path;
  if (a->RuntimeGetVersion(&info.runtime_version) != cudart::kSuccess) info.runtime_version = 0;
  if (a->DriverGetVersion(&info.driver_version) != cudart::kSuccess) info.driver_version = 0;
  a->GetLastError();
  return info;
}

void* host_alloc_pinned(size_t nbytes, int* device) {
  const cudart::Api& a = require("pinned host memory");
  check(a, a.GetDevice(device), "cudaGetDevice");
  void* ptr = nullptr;
  // Portable: the arena serves every device of the process, not only the current one.
  check(a, a.HostAlloc(&ptr, nbytes, cudart::kHostAllocPortable), "cudaHostAlloc");
  return ptr;
}

void host_free_pinned(void* ptr, int device) noexcept {
  const cudart::Api* a = cudart::api(nullptr);
  if (a == nullptr) return;
  // A thread per arena freed (rare; cudaFreeHost itself costs far more): only a thread of
  // our own can set the device without changing, or having to restore, anyone's current one.
  auto free_on_device = [a, ptr, device] {
    a->SetDevice(device);
    a->FreeHost(ptr);
    a->GetLastError();
  };
  try {
    std::thread(free_on_device).join();
  } catch (...) {  // no thread to be had: free here, on whatever device is current
    a->FreeHost(ptr);
    a->GetLastError();
  }
}

int current_device() {
  const cudart::Api& a = require("current_device");
  int device = 0;
  check(a, a.GetDevice(&device), "cudaGetDevice");
  return device;
}

int stream_device(uintptr_t stream) {
  if (stream == 0) return current_device();  // legacy default stream: the current device's
  const cudart::Api& a = require("stream_device");
  if (a.StreamGetDevice == nullptr) return current_device();  // runtime < 12.8: trust the caller's device
  int device = 0;
  check(a, a.StreamGetDevice(reinterpret_cast<cudart::Stream>(stream), &device), "cudaStreamGetDevice");
  return device;
}

void enter_engine_thread(int device) {
  const cudart::Api& a = require("enter_engine_thread");
  check(a, a.SetDevice(device), "cudaSetDevice");
  thread_local bool relaxed = false;
  if (!relaxed) {
    auto mode = cudart::kStreamCaptureModeRelaxed;
    check(a, a.ThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    relaxed = true;
  }
}

bool stream_capturing(uintptr_t stream) {
  const cudart::Api& a = require("stream_capturing");
  auto status = cudart::kStreamCaptureStatusNone;
  check(a, a.StreamIsCapturing(reinterpret_cast<cudart::Stream>(stream), &status),
        "cudaStreamIsCapturing");
  return status != cudart::kStreamCaptureStatusNone;
}

void copy_d2h(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event) {
  copy(dst, src, nbytes, stream, event, cudart::kMemcpyDeviceToHost, "cudaMemcpyAsync (device to host)");
}

void copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event) {
  copy(dst, src, nbytes, stream, event, cudart::kMemcpyHostToDevice, "cudaMemcpyAsync (host to device)");
}

void event_synchronize(uintptr_t event) {
  const cudart::Api& a = require("event_synchronize");
  check(a, a.EventSynchronize(reinterpret_cast<cudart::Event>(event)), "cudaEventSynchronize");
}

void record_event(uintptr_t event, uintptr_t stream) {
  const cudart::Api& a = require("record_event");
  check(a, a.EventRecord(reinterpret_cast<cudart::Event>(event), reinterpret_cast<cudart::Stream>(stream)),
        "cudaEventRecord");
}

void stream_synchronize_noexcept(uintptr_t stream) noexcept {
  if (const cudart::Api* a = cudart::api(nullptr)) {
    a->StreamSynchronize(reinterpret_cast<cudart::Stream>(stream));
    a->GetLastError();
  }
}

uintptr_t record_private_event(uintptr_t stream) {
  const cudart::Api& a = require("record_private_event");
  cudart::Event event = nullptr;
  check(a, a.EventCreateWithFlags(&event, cudart::kEventBlockingSync | cudart::kEventDisableTiming),
        "cudaEventCreateWithFlags");
  cudart::Error err = a.EventRecord(event, reinterpret_cast<cudart::Stream>(stream));
  if (err != cudart::kSuccess) {
    a.EventDestroy(event);
    check(a, err, "cudaEventRecord");
  }
  return reinterpret_cast<uintptr_t>(event);
}

void destroy_event(uintptr_t event) noexcept {
  if (const cudart::Api* a = cudart::api(nullptr)) a->EventDestroy(reinterpret_cast<cudart::Event>(event));
}

#else  // CPU-only build (OFFLOAD_WITH_CUDA=OFF)


namespace {
[[noreturn]] void unavailable(const char* what) {
  throw std::runtime_error(std::string(what) +
                           " needs CUDA, but offload._C was built without its CUDA paths "
                           "(OFFLOAD_BUILD_CUDA=0); reinstall with OFFLOAD_BUILD_CUDA unset");
}
}  // namespace

bool compiled() noexcept { return false; }
bool usable() noexcept { return false; }
std::string unusable_reason() {
  return "offload._C was built without its CUDA paths (OFFLOAD_BUILD_CUDA=0)";
}
RuntimeInfo runtime_info() { return {}; }
void* host_alloc_pinned(size_t, int*) { unavailable("pinned host memory"); }
void host_free_pinned(void*, int) noexcept {}
int current_device() { unavailable("current_device"); }
int stream_device(uintptr_t) { unavailable("stream_device"); }
void enter_engine_thread(int) { unavailable("enter_engine_thread"); }
bool stream_capturing(uintptr_t) { unavailable("stream_capturing"); }
void copy_d2h(uintptr_t, uintptr_t, size_t, uintptr_t, uintptr_t) { unavailable("copy_d2h"); }
void copy_h2d(uintptr_t, uintptr_t, size_t, uintptr_t, uintptr_t) { unavailable("copy_h2d"); }
void event_synchronize(uintptr_t) { unavailable("event_synchronize"); }
void record_event(uintptr_t, uintptr_t) { unavailable("record_event"); }
void stream_synchronize_noexcept(uintptr_t) noexcept {}
uintptr_t record_private_event(uintptr_t) { unavailable("record_private_event"); }
void destroy_event(uintptr_t) noexcept {}

#endif

}  // namespace offload::cuda

#include "cudart.hpp"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace offload::cudart {

namespace {

std::mutex g_mu;
std::atomic<const Api*> g_api{nullptr};

// Paths of the CUDA runtime libraries the process has loaded, in load order (torch's
// comes with `import torch`, before anything of ours runs).
int collect(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const char* base = std::strrchr(name, '/');
  base = base ? base + 1 : name;
  if (std::strncmp(base, "libcudart.so", 12) == 0)
    static_cast<std::vector<std::string>*>(out)->emplace_back(name);
  return 0;
}

template <class F>
bool bind(void* lib, const char* symbol, F& slot, std::string* missing) {
  slot = reinterpret_cast<F>(dlsym(lib, symbol));
  if (slot == nullptr && missing != nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
  }
  return slot != nullptr;
}

std::unique_ptr<Api> resolve(const std::string& path, std::string* why) {
  // RTLD_NOLOAD: a handle to the copy already mapped (torch's), never a second one.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    const char* err = dlerror();
    *why = "cannot open the loaded CUDA runtime " + path + ": " + (err ? err : "dlopen failed");
    return nullptr;
  }
  auto a = std::make_unique<Api>();
  std::string missing;
  bind(lib, "cudaGetDeviceCount", a->GetDeviceCount, &missing);
  bind(lib, "cudaGetErrorString", a->GetErrorString, &missing);
  bind(lib, "cudaGetLastError", a->GetLastError, &missing);
  bind(lib, "cudaRuntimeGetVersion", a->RuntimeGetVersion, &missing);
  bind(lib, "cudaDriverGetVersion", a->DriverGetVersion, &missing);
  bind(lib, "cudaHostAlloc", a->HostAlloc, &missing);
  bind(lib, "cudaFreeHost", a->FreeHost, &missing);
  bind(lib, "cudaGetDevice", a->GetDevice, &missing);
  bind(lib, "cudaSetDevice", a->SetDevice, &missing);
  bind(lib, "cudaMemcpyAsync", a->MemcpyAsync, &missing);
  bind(lib, "cudaEventCreateWithFlags", a->EventCreateWithFlags, &missing);
  bind(lib, "cudaEventDestroy", a->EventDestroy, &missing);
  bind(lib, "cudaEventRecord", a->EventRecord, &missing);
  bind(lib, "cudaEventSynchronize", a->EventSynchronize, &missing);
  bind(lib, "cudaStreamSynchronize", a->StreamSynchronize, &missing);
  bind(lib, "cudaStreamIsCapturing", a->StreamIsCapturing, &missing);
  bind(lib, "cudaThreadExchangeStreamCaptureMode", a->ThreadExchangeStreamCaptureMode, &missing);
  bind(lib, "cudaStreamGetDevice", a->StreamGetDevice, nullptr);  // optional
  if (!missing.empty()) {
    *why = "the CUDA runtime " + path + " lacks " + missing +
           " (a CUDA runtime of version 10.1 or newer is needed)";
    dlclose(lib);
    return nullptr;
  }
  a->path = path;
  return a;  // the handle stays open for the life of the process
}

}  // namespace

const Api* api(std::string* why) {
  if (const Api* a = g_api.load(std::memory_order_acquire)) return a;
  std::lock_guard<std::mutex> lock(g_mu);
  if (const Api* a = g_api.load(std::memory_order_relaxed)) return a;
  std::vector<std::string> paths;
  dl_iterate_phdr(collect, &paths);
  std::string reason =
      "no CUDA runtime library (libcudart.so.*) is loaded in this process: the GPU paths "
      "use the one torch loads, and a CPU-only torch loads none";
  for (const std::string& path : paths) {
    std::unique_ptr<Api> a = resolve(path, &reason);
    if (a) {
      const Api* p = a.release();  // lives as long as the process, like the library
      g_api.store(p, std::memory_order_release);
      return p;
    }
  }
  if (why != nullptr) *why = reason;
  return nullptr;
}

}  // namespace offload::cudart

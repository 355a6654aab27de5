// The CUDA runtime, seen through integers (pointers, stream and event handles) so that
// no libtorch header is needed and one build serves any torch version. CUDA builds call
// the runtime torch loaded, found at run time (cudart.hpp says why); without one, and in
// CPU-only builds (OFFLOAD_WITH_CUDA=OFF), every function except compiled(), usable(),
// unusable_reason() and runtime_info() throws std::runtime_error naming the reason, and the
// noexcept ones do nothing (nothing can have been allocated through a runtime that is not
// there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload::cuda {

bool compiled() noexcept;
// A CUDA runtime is loaded, the driver accepts it and there is at least one device. Never
// throws. Cached once a runtime was found (the first call initializes it, which costs
// milliseconds); "no runtime loaded" is not cached, so a runtime loaded later counts.
bool usable() noexcept;
// Why usable() is false ("" when it is true).
std::string unusable_reason();

// The runtime the CUDA paths use: its path and versions (1000 * major + 10 * minor, as the
// runtime reports them; 0 when it could not say). `path` is empty when none is loaded.
struct RuntimeInfo {
  std::string path;
  int runtime_version = 0;
  int driver_version = 0;
};
RuntimeInfo runtime_info();

// Page-locked host memory for the arena (one call per arena, never per tensor).
void* host_alloc_pinned(size_t nbytes);
void host_free_pinned(void* ptr) noexcept;

// Device of the calling thread (the runtime follows a context made current by torch).
int current_device();
// Device a stream belongs to.
int stream_device(uintptr_t stream);
void set_device(int device);

// cudaMemcpyAsync on `stream`, then cudaEventRecord(event, stream) when event != 0.
void copy_d2h(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event);
void copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event);

void event_synchronize(uintptr_t event);
void record_event(uintptr_t event, uintptr_t stream);
// Waits for everything queued on `stream`; errors are ignored (for error paths that
// must not let go of memory a queued copy still reads).
void stream_synchronize_noexcept(uintptr_t stream) noexcept;

// A private event marking "everything queued on `stream` so far"; lets the store keep
// a pinned block alive until an H2D copy from it has finished on the device.
uintptr_t record_private_event(uintptr_t stream);
void destroy_event(uintptr_t event) noexcept;

}  // namespace offload::cuda

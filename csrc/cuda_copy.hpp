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

// Page-locked host memory for the arena (one call per arena, never per tensor), allocated
// in the calling thread's current device's context (`*device` receives that device).
void* host_alloc_pinned(size_t nbytes, int* device);
// Frees it on a short-lived thread of its own that makes `device` current first: the
// caller may be any thread (the last owner of an arena can be an I/O worker, the release
// thread or a Python thread), and neither a context on another GPU nor a change to the
// caller's current device may come of it. Errors are ignored.
void host_free_pinned(void* ptr, int device) noexcept;

// Device of the calling thread (the runtime follows a context made current by torch).
int current_device();
// Device a stream belongs to.
int stream_device(uintptr_t stream);
// For a thread of ours (engine, release or I/O thread) about to call the runtime for work on
// `device`: makes `device` current (a thread that never set one would act on device 0 and
// create a context there) and, once per thread, puts the thread in relaxed graph-capture
// mode, so its waits on our own events stay legal, and leave a capture intact, while another
// thread captures a CUDA graph in global mode.
void enter_engine_thread(int device);
// Whether `stream` is capturing a CUDA graph (work queued on it would be recorded into the
// graph, not run).
bool stream_capturing(uintptr_t stream);

// cudaMemcpyAsync on `stream`, then cudaEventRecord(event, stream) when event != 0.
void copy_d2h(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event);
void copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, uintptr_t event);

void event_synchronize(uintptr_t event);
void record_event(uintptr_t event, uintptr_t stream);
// Waits for everything queued on `stream`; errors are ignored (for error paths that
// must not let go of memory a queued copy still reads).
void stream_synchronize_noexcept(uintptr_t stream) noexcept;

// A private event marking "everything queued on `stream` so far"; lets the store keep
// a pinned block alive until an H2D copy from it has finished on the device. Created with
// cudaEventBlockingSync (the release thread that waits on it sleeps instead of spinning a
// core, as for the D2H events of copies.py Note 4) and without timing.
uintptr_t record_private_event(uintptr_t stream);
void destroy_event(uintptr_t event) noexcept;

}  // namespace offload::cuda

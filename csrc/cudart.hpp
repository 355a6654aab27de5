// Our own declarations of the few CUDA runtime entry points the core uses, resolved at run
// time from the CUDA runtime library that torch already loaded. No CUDA toolkit is needed
// to build, and the module links no CUDA library, so it imports on any machine.
//
// Why torch's runtime (libcudart.so.N, found among the process's loaded objects) and not
// the driver API of libcuda.so.1:
// - It is the runtime torch itself runs on, so the GPU paths work exactly where
//   torch.cuda does: whatever runtime/driver pairing torch achieved is ours too. A runtime
//   of our own (the static CUDA 13 one we linked before) refuses drivers older than itself
//   while torch's runtime on the same machine runs fine.
// - One runtime in the process: torch's primary context, torch's notion of the current
//   device per thread, no second copy of the runtime's state. Engine threads pick the
//   device with cudaSetDevice exactly as torch's own threads do; with the driver API each
//   engine thread would need our own context bookkeeping (cuCtxSetCurrent of the stream's
//   context), which nothing here could test without a GPU.
// - The signatures and constants below have not changed since CUDA 10.1; a test compiles
//   them against the toolkit's cuda_runtime_api.h wherever one is installed.
// Graph capture: an engine thread puts itself in relaxed capture mode (cuda_copy.hpp,
// enter_engine_thread), so that its waits on our own events stay legal while another thread
// captures a CUDA graph in global mode (and do not invalidate that capture).
// A runtime loaded after the first look (torch linked statically, runtime loaded by hand
// with ctypes) is found at the next call: only success is cached.
#pragma once

#include <string>

struct CUstream_st;  // the runtime's opaque handle types; same names as in its headers
struct CUevent_st;

namespace offload::cudart {

using Error = int;  // cudaError_t: an enum, int-sized in every ABI we build for
using Stream = CUstream_st*;
using Event = CUevent_st*;
enum MemcpyKind : int { kMemcpyHostToDevice = 1, kMemcpyDeviceToHost = 2 };
enum StreamCaptureStatus : int { kStreamCaptureStatusNone = 0, kStreamCaptureStatusActive = 1,
                                 kStreamCaptureStatusInvalidated = 2 };
enum StreamCaptureMode : int { kStreamCaptureModeGlobal = 0, kStreamCaptureModeThreadLocal = 1,
                               kStreamCaptureModeRelaxed = 2 };

constexpr Error kSuccess = 0;
constexpr unsigned kHostAllocPortable = 0x01;
constexpr unsigned kEventBlockingSync = 0x01;
constexpr unsigned kEventDisableTiming = 0x02;

// Function pointers into the loaded runtime (member names drop the `cuda` prefix).
struct Api {
  Error (*GetDeviceCount)(int*);
  const char* (*GetErrorString)(Error);
  Error (*GetLastError)();
  Error (*RuntimeGetVersion)(int*);
  Error (*DriverGetVersion)(int*);
  Error (*HostAlloc)(void**, size_t, unsigned int);
  Error (*FreeHost)(void*);
  Error (*GetDevice)(int*);
  Error (*SetDevice)(int);
  Error (*MemcpyAsync)(void*, const void*, size_t, MemcpyKind, Stream);
  Error (*EventCreateWithFlags)(Event*, unsigned int);
  Error (*EventDestroy)(Event);
  Error (*EventRecord)(Event, Stream);
  Error (*EventSynchronize)(Event);
  Error (*StreamSynchronize)(Stream);
  Error (*StreamIsCapturing)(Stream, StreamCaptureStatus*);
  Error (*ThreadExchangeStreamCaptureMode)(StreamCaptureMode*);
  Error (*StreamGetDevice)(Stream, int*);  // CUDA >= 12.8 only; nullptr before

  std::string path;  // the library the pointers come from
};

// The loaded runtime's entry points, or nullptr with `*why` saying why there are none.
// Never loads a library of its own: it looks for a libcudart.so* already in the process.
const Api* api(std::string* why);

}  // namespace offload::cudart

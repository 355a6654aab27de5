/* A stand-in CUDA runtime for CPU machines (tests/test_cuda_dlopen.py): the entry points
 * offload._C resolves at run time, with "device" memory being host memory, so the core's
 * CUDA paths (pinned arena, copies, events, the store's chained write and read) run and
 * move real bytes without a GPU. Copies are synchronous; events are plain flags.
 *
 * Knobs (environment): FAKE_CUDART_DEVICES (device count, default 1),
 * FAKE_CUDART_FAIL=memcpy|hostalloc (that call returns error 700). Counters are exported
 * for the test to read through ctypes. Built by the test with `cc -shared -fPIC`. */
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

long fake_host_allocs, fake_host_frees, fake_memcpys, fake_memcpy_bytes, fake_event_syncs;
static __thread int current_device;
static __thread cudaError_t last_error;

static int failing(const char* what) {
  const char* f = getenv("FAKE_CUDART_FAIL");
  return f != NULL && strcmp(f, what) == 0;
}
static cudaError_t fail(void) { return last_error = 700; }

cudaError_t cudaGetDeviceCount(int* count) {
  const char* n = getenv("FAKE_CUDART_DEVICES");
  *count = n ? atoi(n) : 1;
  return 0;
}
const char* cudaGetErrorString(cudaError_t err) { return err == 0 ? "no error" : "fake failure"; }
cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = 0; return e; }
cudaError_t cudaRuntimeGetVersion(int* v) { *v = 99000; return 0; }
cudaError_t cudaDriverGetVersion(int* v) { *v = 99010; return 0; }
cudaError_t cudaHostAlloc(void** ptr, size_t n, unsigned int flags) {
  (void)flags;
  if (failing("hostalloc")) return fail();
  if (posix_memalign(ptr, 4096, n ? n : 1) != 0) return fail();
  fake_host_allocs++;
  return 0;
}
cudaError_t cudaFreeHost(void* ptr) { free(ptr); fake_host_frees++; return 0; }
cudaError_t cudaGetDevice(int* d) { *d = current_device; return 0; }
cudaError_t cudaSetDevice(int d) { current_device = d; return 0; }
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, cudaStream_t s) {
  (void)kind; (void)s;
  if (failing("memcpy")) return fail();
  memcpy(dst, src, n);
  fake_memcpys++;
  fake_memcpy_bytes += (long)n;
  return 0;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  (void)flags;
  *e = (cudaEvent_t)malloc(16);
  return 0;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return 0; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)e; (void)s; return 0; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; fake_event_syncs++; return 0; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return 0; }
cudaError_t cudaStreamGetDevice(cudaStream_t s, int* d) { (void)s; *d = current_device; return 0; }

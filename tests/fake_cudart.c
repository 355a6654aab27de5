/* A stand-in CUDA runtime for CPU machines: the entry points offload._C resolves at run time
 * (csrc/cudart.hpp), with "device" memory being host memory, strict where the core's
 * correctness depends on what CUDA does rather than on what a kind stand-in would do:
 *
 * - Copies are asynchronous: cudaMemcpyAsync queues the copy and returns; one worker thread
 *   (the "device") runs queued copies and event records in order, each copy after a delay
 *   (FAKE_CUDART_COPY_DELAY_US, default 2000). A reader that does not wait for the copy's
 *   event reads the bytes from before it.
 * - Events honour their flags: cudaEventSynchronize on an event created without
 *   cudaEventBlockingSync spins (yields in a loop, like the runtime's default spin-wait) and
 *   is counted in fake_spin_syncs; with the flag it sleeps on a condition variable.
 * - The current device is per thread and unset on a new thread. A call that needs a context
 *   on a thread that never called cudaSetDevice is recorded (fake_calls_without_device, the
 *   first one's name in fake_first_call_without_device) and, like the real runtime, uses
 *   device 0. fake_contexts has bit d set once device d's primary context exists;
 *   fake_free_devices has bit d set once cudaFreeHost ran with device d current.
 * - Graph capture (global mode): fake_begin_capture(stream) starts one as if another thread
 *   captured on `stream`. Until fake_end_capture(), event queries and synchronizations, and
 *   stream synchronizations, on any thread still in the default (global) capture mode
 *   (cudaThreadExchangeStreamCaptureMode) return cudaErrorStreamCaptureUnsupported and
 *   invalidate the capture; fake_end_capture() returns 1 if it was invalidated. Copies and
 *   records on the capturing stream are captured (counted in fake_captured_ops), not run.
 *
 * Other knobs: FAKE_CUDART_DEVICES (device count, default 1), FAKE_CUDART_FAIL=memcpy|hostalloc
 * (that call returns error 700), FAKE_CUDART_SKIP_EVENT_SYNC=1 (cudaEventSynchronize returns
 * at once: the sabotage that shows a missing wait reads stale bytes). Counters are exported
 * for the tests to read through ctypes. Built by tests/fake_runtime.py with `cc -shared -fPIC`. */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

enum { kSuccess = 0, kInvalidValue = 1, kInvalidDevice = 101, kNotReady = 600,
       kFake = 700, kCaptureUnsupported = 900 };
enum { kBlockingSync = 0x01 };
enum { kCaptureGlobal = 0, kCaptureThreadLocal = 1, kCaptureRelaxed = 2 };

long fake_host_allocs, fake_host_frees, fake_memcpys, fake_memcpy_bytes, fake_event_syncs;
long fake_spin_syncs, fake_calls_without_device, fake_capture_violations, fake_captured_ops;
unsigned long fake_contexts, fake_free_devices;
char fake_first_call_without_device[64];

static __thread int current_device = -1;   /* -1: this thread never called cudaSetDevice */
static __thread int capture_mode = kCaptureGlobal;
static __thread cudaError_t last_error;

/* ---------------------------------------------------------------- the device: one worker */
struct CUevent_st {
  unsigned flags;
  long records;    /* records enqueued */
  long reached;    /* records the worker has run */
  int destroyed;   /* destroyed with a record still queued: freed by the worker after it */
};

typedef struct Op {
  struct Op* next;
  void* dst;
  const void* src;
  size_t n;
  struct CUevent_st* event; /* a record when non-null */
  long record;
} Op;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static Op *head, *tail;
static long enqueued, finished;
static int worker_started;
static cudaStream_t capturing_stream;
static int capture_active, capture_invalidated;

static long copy_delay_us(void) {
  const char* d = getenv("FAKE_CUDART_COPY_DELAY_US");
  return d ? atol(d) : 2000;
}

static void* worker(void* arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  for (;;) {
    while (head == NULL) pthread_cond_wait(&work_cv, &mu);
    Op* op = head;
    pthread_mutex_unlock(&mu);
    if (op->event == NULL) {
      usleep((useconds_t)copy_delay_us());
      memcpy(op->dst, op->src, op->n);
    }
    pthread_mutex_lock(&mu);
    head = op->next;
    if (head == NULL) tail = NULL;
    if (op->event != NULL) {
      if (op->event->reached < op->record) op->event->reached = op->record;
      if (op->event->destroyed && op->event->reached >= op->event->records) free(op->event);
    }
    finished++;
    free(op);
    pthread_cond_broadcast(&done_cv);
  }
  return NULL;
}

/* Caller holds mu. */
static void enqueue(Op* op) {
  if (!worker_started) {
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_detach(t);
    worker_started = 1;
  }
  op->next = NULL;
  if (tail) tail->next = op; else head = op;
  tail = op;
  enqueued++;
  pthread_cond_signal(&work_cv);
}

/* ---------------------------------------------------------------- checks shared by the calls */
static int failing(const char* what) {
  const char* f = getenv("FAKE_CUDART_FAIL");
  return f != NULL && strcmp(f, what) == 0;
}
static cudaError_t fail(cudaError_t err) { return last_error = err; }

static int device_count(void) {
  const char* n = getenv("FAKE_CUDART_DEVICES");
  return n ? atoi(n) : 1;
}

/* A call that needs a context: on a thread that never set a device, the runtime would make
 * device 0 current (and create its context): recorded, then done as the runtime does. */
static void needs_device(const char* call) {
  if (current_device >= 0) return;
  pthread_mutex_lock(&mu);
  if (fake_calls_without_device++ == 0)
    strncpy(fake_first_call_without_device, call, sizeof fake_first_call_without_device - 1);
  fake_contexts |= 1ul;
  pthread_mutex_unlock(&mu);
}

/* An unsafe call during another thread's global-mode capture (caller holds mu): refused,
 * capture invalidated, unless this thread left the global mode. */
static int refused_by_capture(void) {
  if (!capture_active || capture_mode != kCaptureGlobal) return 0;
  capture_invalidated = 1;
  fake_capture_violations++;
  return 1;
}

/* ---------------------------------------------------------------- the runtime's entry points */
cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return kSuccess;
}
const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case kSuccess: return "no error";
    case kInvalidDevice: return "invalid device ordinal";
    case kCaptureUnsupported: return "operation not permitted when stream is capturing";
    default: return "fake failure";
  }
}
cudaError_t cudaGetLastError(void) { cudaError_t e = last_error; last_error = 0; return e; }
cudaError_t cudaRuntimeGetVersion(int* v) { *v = 99000; return kSuccess; }
cudaError_t cudaDriverGetVersion(int* v) { *v = 99010; return kSuccess; }

cudaError_t cudaGetDevice(int* d) {
  *d = current_device < 0 ? 0 : current_device;   /* no context is made by asking */
  return kSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= device_count()) return fail(kInvalidDevice);
  current_device = d;
  pthread_mutex_lock(&mu);
  fake_contexts |= 1ul << d;   /* CUDA 12+: cudaSetDevice initializes the primary context */
  pthread_mutex_unlock(&mu);
  return kSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t n, unsigned int flags) {
  (void)flags;
  needs_device("cudaHostAlloc");
  if (failing("hostalloc")) return fail(kFake);
  if (posix_memalign(ptr, 4096, n ? n : 1) != 0) return fail(kFake);
  pthread_mutex_lock(&mu);
  fake_host_allocs++;
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaFreeHost(void* ptr) {
  needs_device("cudaFreeHost");
  free(ptr);
  pthread_mutex_lock(&mu);
  fake_host_frees++;
  fake_free_devices |= 1ul << (current_device < 0 ? 0 : current_device);
  pthread_mutex_unlock(&mu);
  return kSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, cudaStream_t s) {
  (void)kind;
  needs_device("cudaMemcpyAsync");
  if (failing("memcpy")) return fail(kFake);
  pthread_mutex_lock(&mu);
  fake_memcpys++;
  fake_memcpy_bytes += (long)n;
  if (capture_active && s == capturing_stream) {
    fake_captured_ops++;   /* part of the graph, not run now */
  } else {
    Op* op = calloc(1, sizeof *op);
    op->dst = dst;
    op->src = src;
    op->n = n;
    enqueue(op);
  }
  pthread_mutex_unlock(&mu);
  return kSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  needs_device("cudaEventCreateWithFlags");
  *e = calloc(1, sizeof **e);
  (*e)->flags = flags;
  return kSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  needs_device("cudaEventDestroy");
  pthread_mutex_lock(&mu);   /* like CUDA: legal with a record pending, freed once it ran */
  if (e->reached < e->records) e->destroyed = 1; else free(e);
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  needs_device("cudaEventRecord");
  pthread_mutex_lock(&mu);
  if (capture_active && s == capturing_stream) {
    fake_captured_ops++;
  } else {
    Op* op = calloc(1, sizeof *op);
    op->event = e;
    op->record = ++e->records;
    enqueue(op);
  }
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  needs_device("cudaEventQuery");
  pthread_mutex_lock(&mu);
  cudaError_t err = refused_by_capture() ? kCaptureUnsupported
                    : e->reached >= e->records ? kSuccess : kNotReady;
  pthread_mutex_unlock(&mu);
  return err == kCaptureUnsupported ? fail(err) : err;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  needs_device("cudaEventSynchronize");
  pthread_mutex_lock(&mu);
  fake_event_syncs++;
  if (refused_by_capture()) {
    pthread_mutex_unlock(&mu);
    return fail(kCaptureUnsupported);
  }
  const char* skip = getenv("FAKE_CUDART_SKIP_EVENT_SYNC");
  const long target = e->records;
  if (skip != NULL && strcmp(skip, "1") == 0) {
    pthread_mutex_unlock(&mu);
    return kSuccess;
  }
  if (e->flags & kBlockingSync) {
    while (e->reached < target) pthread_cond_wait(&done_cv, &mu);
  } else {
    fake_spin_syncs++;   /* the runtime's default wait: a core busy until the event */
    while (e->reached < target) {
      pthread_mutex_unlock(&mu);
      sched_yield();
      pthread_mutex_lock(&mu);
    }
  }
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  (void)s;   /* one device queue: waiting for all of it covers the stream */
  needs_device("cudaStreamSynchronize");
  pthread_mutex_lock(&mu);
  if (refused_by_capture()) {
    pthread_mutex_unlock(&mu);
    return fail(kCaptureUnsupported);
  }
  const long target = enqueued;
  while (finished < target) pthread_cond_wait(&done_cv, &mu);
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaStreamGetDevice(cudaStream_t s, int* d) {
  (void)s;
  *d = current_device < 0 ? 0 : current_device;
  return kSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, int* status) {
  pthread_mutex_lock(&mu);
  *status = capture_active && s == capturing_stream ? (capture_invalidated ? 2 : 1) : 0;
  pthread_mutex_unlock(&mu);
  return kSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(int* mode) {
  if (*mode < kCaptureGlobal || *mode > kCaptureRelaxed) return fail(kInvalidValue);
  int old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  return kSuccess;
}

/* ---------------------------------------------------------------- for the tests */
void fake_begin_capture(cudaStream_t s) {
  pthread_mutex_lock(&mu);
  capturing_stream = s;
  capture_active = 1;
  capture_invalidated = 0;
  pthread_mutex_unlock(&mu);
}
int fake_end_capture(void) {
  pthread_mutex_lock(&mu);
  int invalidated = capture_invalidated;
  capture_active = 0;
  capturing_stream = NULL;
  pthread_mutex_unlock(&mu);
  return invalidated;
}
/* Waits until the device has run everything queued so far (no per-thread checks). */
void fake_drain(void) {
  pthread_mutex_lock(&mu);
  const long target = enqueued;
  while (finished < target) pthread_cond_wait(&done_cv, &mu);
  pthread_mutex_unlock(&mu);
}

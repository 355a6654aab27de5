// The nvme tier's transfers: every write and read in flight for one tier's payloads, from
// the store of a storage to the hand-out of its bytes (Python class NvmeTransfers,
// bind_nvme_transfers.cpp; the tier, tiers/nvme.py, makes one per step and keeps the
// lifecycle, the CUDA copies and the settings). What every stored storage pays runs here with no Python in between: the
// extent's allocation, the write in place and its batch, the backpressure, the read into
// memory of the payload's phase, the wait and the hand-out, the release.
//
// NOTE [Write batches] Direct writes (host memory written in place) go to the engine in
// batches: handing one over costs a lock and a worker wake-up, which on a machine with few
// cores preempts a compute thread. A batch is submitted when it holds `write_batch` writes
// or `batch_bytes`, and before anything waits on a write or reads (retire, backpressure,
// the first read of the backward, drain, close): nothing ever waits on a write not
// submitted. The block's exit submits what is left (`submit`, tiers/nvme.py `flush`): a
// backward run after the block may come much later, and the batch's sources stay in memory
// until their writes land. A payload released while its write is still batched is submitted first, so
// the engine holds its extent's range and the range can go back at once. Submitting runs
// no Python code between taking the batch and handing it over: no release can come in
// between (the garbage collector runs only where Python code or a tracked allocation does).
//
// NOTE [A source that moved] A direct write takes its storage's address at the pack and
// keeps the storage alive, not that memory. Code that gives a live storage new memory
// (`share_memory_()`, which a torch.multiprocessing queue's `put` calls; a storage
// `resize_` there and back) frees the old memory while the write may still wait in its
// batch, or while the engine writes it. So before a batch goes to the engine, each write
// asks its storage where its bytes are now; one that moved is written from a copy of its
// bytes as they are now (the bytes autograd reads in backward), at the same phase. Retiring
// a write asks again, and a write that failed with EFAULT (its memory was unmapped under
// the engine) counts as moved: it is written once more, from a copy; every read retires its
// payload's write first (NOTE [Read after write]). The engine copies what it bounces (partial
// sectors, small writes, out-of-phase chunks) through the kernel (io_engine.cpp
// `copy_source`), and so does the checksum of a direct write (`source_crc32c`), so memory
// unmapped under it is an EFAULT there too, not a crash of the process (a memcpy faulted:
// found by an ASan run). A move after the retire is harmless: the write had landed before
// the old memory was freed. Not seen: a storage that moves while the engine reads it and
// comes back to the same address (a resize there and back can), whose write may hold bytes
// of neither. Moving a saved tensor's storage while the step runs is what this covers as
// far as it can, not something to do.
//
// NOTE [Read after write] The engine does not order a read after a write of the same
// extent; reading before the write landed returns stale bytes. Every read first retires its
// payload's write.
//
// NOTE [Deferred free] Memory the engine reads from or into must outlive the I/O. The
// engine keeps the extent's range alive until a request is done, so a released payload gives
// its extent back at once. A host read lands in memory its request holds (`read_into`); a
// direct write reads the source tensor's own memory, which the write keeps (`source`) until
// it is retired, released payload or not; a chained read's H2D ticket holds its block and
// destination until the copy is done. A released payload's read is kept in `deferred` until
// it lands (drain waits for it: a drained tier has nothing in flight). `release` never
// blocks.
//
// Threads: every member is read and changed with the GIL held. The GIL is let go only
// around a wait on the core's request, by code that holds its own references to what it
// waits on and touches nothing else until it has the GIL back; records die on whatever
// thread autograd drops them (their release runs here under the step's meter lock).
//
// Not tracked by the garbage collector: what the transfers hold (the store, the step's Stats,
// util.ranges, payloads and their transfers: nvme_payload.cpp) never refers back to them.
//
// This header is the transfers' state and operations: nvme_writes.cpp (writes, batches,
// backpressure), nvme_reads.cpp (reads and their hand-out), nvme_transfers.cpp (completions,
// the step's figures, a payload's allocation and release, closing).
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "nvme_payload.hpp"
#include "py_calls.hpp"

namespace offload::bind::nvme {

namespace py = pybind11;

// Names the transfers look up and call, interned once (init_io_names, at import).
struct IoNames {
  PyObject *done, *wait, *end_s, *add_stall, *add, *tensor_for_use, *allocate, *release,
      *data_ptr, *nbytes, *span, *profiling, *write_range, *wait_range,
      *category, *args, *io, *bytes, *dtype_kw, *write_kind, *read_kind, *trace, *enabled;
};
extern IoNames io_names;
void init_io_names();

inline constexpr const char* kUsedAfterClose =
    "offload: nvme tier used after close (the context's close() ran inside its block, or the "
    "step was freed after an exception); call ctx.close() after the block and its backward";
inline constexpr const char* kFetchReleased =
    "offload: a saved tensor was used after its offload.activations() context released it "
    "(the block exited with an exception, or backward ran after the context was closed)";

struct State {
  PyObject* store_obj = nullptr;          // the store's Python object
  std::shared_ptr<NvmeStore> store;       // the core's store, or null: another one (a
  //                                         simulated engine) used through Python calls
  std::shared_ptr<HostArena> arena;       // host reads land here while it has room
  PyObject* stats = nullptr;              // the step's Stats (add_stall on a wait)
  PyObject* trace = nullptr;              // stats.trace while it records, else null
  PyObject* ranges = nullptr;             // offload.util.ranges: profiler ranges ...
  PyObject* profiling = nullptr;          // ... and its flag (torch's, a C call)
  PyObject* frombuffer = nullptr;         // torch.frombuffer
  PyObject* uint8 = nullptr;              // torch.uint8
  uint64_t alignment = 4096;
  uint64_t direct_cap = 1;                // bytes of direct-write sources held at most
  uint64_t batch_limit = 0;
  size_t write_batch = 1;

  std::deque<PyObject*> writes;           // payloads in write order (owned); an entry
  //                                         retired out of order lingers until the front
  std::vector<PyObject*> batch;           // payloads whose direct write is not submitted
  uint64_t batch_bytes = 0;
  uint64_t direct_inflight = 0;           // bytes of direct-write sources held
  std::deque<std::shared_ptr<NvmeRead>> reads;   // submission order until seen done (the
  //                                         engine serves them first in, first out)
  size_t pending_reads = 0;               // entries of `reads` not yet observed
  std::vector<std::shared_ptr<NvmeRead>> deferred;   // NOTE [Deferred free]
  std::unordered_set<PyObject*> live;     // stored, not yet released (owned; abort frees)
  int64_t own_bytes = 0;                  // this tier's share of the store
  bool in_backward = false;               // stall attribution: set at the first read
  bool closed = false;

  // Figures folded into the step's Stats (take_counts).
  uint64_t written_bytes = 0, read_bytes = 0;
  size_t peak_writes = 0, peak_reads = 0;
  bool taking_counts = false;             // m_take_counts runs (a call inside it takes none)
  std::vector<std::pair<double, double>> write_busy, read_busy;

  ~State() {
    for (PyObject* p : writes) Py_DECREF(p);
    for (PyObject* p : batch) Py_DECREF(p);
    for (PyObject* p : live) Py_DECREF(p);
    reads.clear();
    deferred.clear();
    Py_XDECREF(store_obj);
    Py_XDECREF(stats);
    Py_XDECREF(trace);
    Py_XDECREF(ranges);
    Py_XDECREF(profiling);
    Py_XDECREF(frombuffer);
    Py_XDECREF(uint8);
  }
};

inline NvmePayload* as_payload(PyObject* obj) { return reinterpret_cast<NvmePayload*>(obj); }
inline py::object steal(PyObject* obj) { return py::reinterpret_steal<py::object>(obj); }
inline py::object borrow(PyObject* obj) { return py::reinterpret_borrow<py::object>(obj); }

// ---- nvme_transfers.cpp: completions, errors, the step's figures, payloads, closing

bool completion_done(const Completion& c);
// Waits for the transfer (the GIL let go for the core's request) and returns the bytes
// moved; throws the transfer's error.
uint64_t completion_wait(const Completion& c);
// When the transfer finished: the engine's time if it keeps one, else now (seen done).
double completion_end_s(const Completion& c);

[[noreturn]] void raise_used_after_close(const char* message);
[[noreturn]] void raise_type_error(const char* message);
void check_open(const State* s);

// A profiler range (util/ranges.py `span`, named by the ranges module's `name_attr`) around
// a block while torch's profiler runs.
class Range : public ProfilerRange {
 public:
  Range(const State* s, PyObject* name_attr);
};

// The training thread waited since `start_s` (Stats.add_stall: its trace span too).
void add_stall(const State* s, double start_s, bool backward, const char* what);
// A transfer's span in the step's trace, when it records one (OFFLOAD_TRACE).
void trace_io(const State* s, bool write, uint64_t nbytes, double start_s, double end_s);

// A payload of `nbytes` with its extent, or None when the store has no range for it (full,
// or too fragmented: the caller spills to the next tier).
py::object allocate(State* s, uint64_t nbytes, PyObject* device, uint64_t phase, bool cuda);
// A CPU storage, written in place from its own memory (NOTE [Phase] in tiers/nvme.py).
py::object store_direct(State* s, PyObject* storage, PyObject* device);
// Gives the payload's extent back at once; never waits for I/O.
void release(State* s, NvmePayload* p);
// Retires landed writes, notes landed reads, frees deferred memory.
void poll(State* s);
// Waits for every write, and for released payloads' reads.
void drain(State* s);
// Waits for every transfer still in flight, dropping failures (nobody needs these bytes).
void wait_all(State* s);
// Hands the batched writes to the engine, then cancels every transfer of this tier the
// engine has not started (`IoRequest::cancel`): a step freed early waits after that only
// for the chunks running, not for a queue of bytes nobody will read.
void cancel_all(State* s);
// Drops every transfer's references, and the store and arena (the tier closes and gives
// them back), once the writes handed to the engine are over (wait_submitted_writes).
void forget(State* s);
// Waits, dropping failures, for every write handed to the engine (close and dealloc: their
// sources may go only once the engine is done reading them).
void wait_submitted_writes(State* s);

// ---- nvme_writes.cpp

// NOTE [Write batches]: hands the batched direct writes to the engine.
void submit(State* s);
// Retires `p`'s write (the caller holds `p`): waits for it, then lets go of what it kept;
// rethrows its error after that. Its queue entry may linger: polls drop entries with none.
void retire(State* s, NvmePayload* p);
// A write the engine starts after a device copy (`future`), or any queued write.
void append_write(State* s, NvmePayload* p, std::shared_ptr<NvmeWrite> write);
// A write from host memory (`source`, kept until retired), batched (NOTE [Write batches]).
void add_direct(State* s, NvmePayload* p, PyObject* source, uintptr_t address);
// Backpressure: retires writes oldest first until `done()`; the wait is a stall.
void retire_oldest(State* s, const std::function<bool()>& done, const char* what);
// Retires the writes that landed, oldest first (stops at the first one that has not).
void poll_writes(State* s);
// Waits for and retires every write.
void drain_writes(State* s);
bool writes_pending(const State* s);
// A write of a released payload not retired yet: its request holds the range it frees.
bool released_write_pending(const State* s);

// ---- nvme_reads.cpp

void add_read(State* s, NvmePayload* p, std::shared_ptr<NvmeRead> read);
// Counts a read's transfer once: its busy interval and its trace span.
void observe(State* s, NvmeRead& read);
// What must come before a read of `p`: the batch, and `p`'s own write (NOTE [Read after
// write]).
void before_read(State* s, NvmePayload* p);
// A read into host memory of the payload's phase (NOTE [Phase] in tiers/nvme.py). Nothing
// is started when, while its write was retired (the GIL let go), the payload was released
// or another thread started its read.
enum class ReadStart { started, in_flight, released };
ReadStart start_host_read(State* s, NvmePayload* p);
// The tier's `prefetch` of a CPU payload: starts its host read; false (nothing started)
// when one is in flight or landed, or the payload was released.
bool prefetch(State* s, NvmePayload* p);
// Notes the reads that landed, oldest first; drops released payloads' reads that landed.
void poll_reads(State* s);
// Drops released payloads' reads once they landed (all of them, waiting, with `wait`).
void reap(State* s, bool wait);
// The payload's bytes: waits for this payload's read (a wait that must sleep, for the small
// reads queued behind it too: nvme_reads.cpp NOTE [Wait for the group]). A host read's are
// handed out as a tensor of `dtype` over the read's memory (storage offset 0; uint8 when
// null, else the payload's nbytes must be a multiple of its size), a chained read's as its
// ticket says.
py::object fetch(State* s, NvmePayload* p, PyObject* dtype = nullptr);

// ---- bind_nvme_transfers.cpp

// The transfers of the core's NvmeTransfers object `obj`, or nullptr for any other object
// (the prefetcher, prefetcher.cpp, reads a CPU payload's bytes through them directly).
State* transfers_state(PyObject* obj);

}  // namespace offload::bind::nvme

// The nvme tier's reads: into host memory of the payload's phase, in submission order until
// seen done (the engine serves them first in, first out, so a poll looks at the oldest one
// only), handed out as a tensor over their memory (nvme_transfers.hpp; NOTE [Read after
// write] and [Deferred free] there).
#include <Python.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "nvme_transfers.hpp"
#include "perf_clock.hpp"
#include "py_calls.hpp"

namespace offload::bind::nvme {

void add_read(State* s, NvmePayload* p, std::shared_ptr<NvmeRead> read) {
  p->read = read;
  s->reads.push_back(std::move(read));
  ++s->pending_reads;
  if (s->pending_reads > s->peak_reads) s->peak_reads = s->pending_reads;
}

void observe(State* s, NvmeRead& read) {
  if (read.observed) return;
  read.observed = true;
  --s->pending_reads;
  const double end = completion_end_s(read.done);
  s->read_busy.emplace_back(read.start_s, end);
  trace_io(s, false, read.nbytes, read.start_s, end);
}

void before_read(State* s, NvmePayload* p) {
  if (p->write_error) std::rethrow_exception(p->write_error);   // NOTE [A failed write ...]
  s->in_backward = true;
  submit(s);   // the reads come now: nothing waits behind them any more
  if (p->write) {
    // A write that landed already is retired without a wait: no stall to count (counting
    // a zero one costs a Python call per read).
    const bool landed = p->write->done.set() && completion_done(p->write->done);
    const double start = landed ? 0.0 : perf_counter_s();
    retire(s, p);
    if (!landed) add_stall(s, start, true, "wait own write");
  }
}

ReadStart start_host_read(State* s, NvmePayload* p) {
  check_open(s);
  before_read(s, p);
  // Retiring the payload's own write lets the GIL go: meanwhile a record dying on another
  // thread may have released the payload (its extent gone: reading it would raise), or
  // another thread's fetch started its read.
  if (p->released) return ReadStart::released;
  if (p->read) return ReadStart::in_flight;
  if (!s->store) raise_type_error("offload: host reads need the core's NvmeStore");
  const uint64_t nbytes = p->nbytes;
  const uint64_t room = nbytes + s->alignment;   // fits `nbytes` at any phase
  std::shared_ptr<HostRegion> memory = s->arena ? s->arena->allocate(room) : nullptr;
  if (!memory) memory = HostArena::create(room, false)->allocate(room);
  const uint64_t address = reinterpret_cast<uintptr_t>(memory->data());
  const uint64_t skip = (p->phase + s->alignment - address % s->alignment) % s->alignment;
  auto read = std::make_shared<NvmeRead>(nbytes, false);
  read->start_s = perf_counter_s();
  read->done.request = s->store->read_into(*p->extent, memory, skip, nbytes);
  read->memory = std::move(memory);
  read->skip = skip;
  add_read(s, p, std::move(read));
  return ReadStart::started;
}

bool prefetch(State* s, NvmePayload* p) {
  // (A failed write's error is for its own fetch to raise, not a read-ahead's caller.)
  if (p->read || p->released || p->write_error) return false;
  return start_host_read(s, p) == ReadStart::started;
}

void reap(State* s, bool wait) {
  std::vector<std::shared_ptr<NvmeRead>> pending;
  pending.swap(s->deferred);   // a release while we wait appends to the new list
  for (auto& read : pending) {
    bool done = false;
    try {
      done = wait || completion_done(read->done);
      if (done) completion_wait(read->done);
    } catch (py::error_already_set&) {
      done = true;   // (the error is dropped with the exception object)
    } catch (const std::exception&) {
      done = true;
    }
    if (!done) s->deferred.push_back(std::move(read));
  }
}

void poll_reads(State* s) {
  while (!s->reads.empty()) {
    std::shared_ptr<NvmeRead> read = s->reads.front();
    if (!read->observed) {
      if (!completion_done(read->done)) break;
      observe(s, *read);
    }
    if (!s->reads.empty() && s->reads.front() == read) s->reads.pop_front();
  }
  if (!s->deferred.empty()) reap(s, false);
}

namespace {

// NOTE [Wait for the group] A wait that sleeps costs the training thread a futex sleep and
// wake-up and the GIL's hand-off, CPU time on top of the time it sleeps. When the backward
// uses small reads faster than the disk serves them, every fetch would sleep once
// (docs/benchmarks.md *Hook cost* has the figures). The engine serves reads first in, first
// out with several workers, so the few small reads queued right behind this one (the next
// ones the backward asks for: the read-ahead starts them in that order) land at about the
// same time: one sleep waits for them too, and their fetches find them landed. Only reads
// smaller in all than kGroupBytes are waited for so: a large read is waited for alone, and
// the backward's compute overlaps the rest.
constexpr uint64_t kGroupBytes = 256 * 1024;
constexpr size_t kGroupReads = 16;

// The last host read queued behind `read` within the group's bounds (or `read` itself).
std::shared_ptr<IoRequest> group_end(const State* s, const NvmeRead& read) {
  std::shared_ptr<IoRequest> end = read.done.request;
  size_t at = 0;
  const size_t n = s->reads.size() < 4 * kGroupReads ? s->reads.size() : 4 * kGroupReads;
  while (at < n && s->reads[at].get() != &read) ++at;
  if (at == n) return end;
  uint64_t bytes = read.nbytes;
  for (size_t i = at + 1; i < s->reads.size() && i - at < kGroupReads; ++i) {
    const NvmeRead& next = *s->reads[i];
    if (next.chained || !next.done.request) break;
    bytes += next.nbytes;
    if (bytes > kGroupBytes) break;
    end = next.done.request;
  }
  return end;
}

// Sleeps until `request` is done, the GIL let go; its outcome is its own fetch's to see.
void wait_quietly(const std::shared_ptr<IoRequest>& request) {
  if (request->done()) return;
  Py_BEGIN_ALLOW_THREADS
  request->wait(std::nullopt);
  Py_END_ALLOW_THREADS
}

// A fetched host read's bytes as a tensor of `dtype` (uint8 when null) over its memory
// (storage offset 0, exactly `nbytes`, the payload's phase), which the tensor keeps alive.
// Typed here, its unpack needs no view as the saved dtype (moved_save.cpp rebuild_flat).
py::object hand_out(const State* s, std::shared_ptr<HostRegion> memory, uint64_t skip,
                    uint64_t nbytes, PyObject* dtype) {
  py::object buffer = steal(new_read_buffer(std::move(memory), skip, nbytes));
  if (!buffer) throw py::error_already_set();
  PyObject* argv[] = {buffer.ptr(), dtype != nullptr ? dtype : s->uint8};
  PyObject* out = PyObject_Vectorcall(s->frombuffer, argv, 1, io_names.dtype_kw);
  if (out == nullptr) throw py::error_already_set();
  return steal(out);
}

}  // namespace

py::object fetch(State* s, NvmePayload* p, PyObject* dtype) {
  if (p->released) raise_used_after_close(kFetchReleased);
  poll(s);   // retire landed writes first: their memory goes back sooner
  if (!p->read && start_host_read(s, p) == ReadStart::released)
    raise_used_after_close(kFetchReleased);
  std::shared_ptr<NvmeRead> read = std::move(p->read);
  if (read->chained) {
    // The current stream waits on the H2D event on the GPU (copies Note 7); CopyStreams
    // counts that wait itself (counted here too, a step's stall could exceed the step).
    py::object out;
    try {
      Range range(s, io_names.wait_range);
      out = call_method(borrow(read->done.future).ptr(), io_names.tensor_for_use);
    } catch (...) {
      observe(s, *read);
      Py_CLEAR(read->done.future);
      throw;
    }
    observe(s, *read);
    Py_CLEAR(read->done.future);   // it may stay in the FIFO until the front: keeps nothing
    s->read_bytes += read->nbytes;
    return out;
  }
  uint64_t moved = 0;
  try {
    // The range marks every read's hand-out under a profiler, landed or not: whether a
    // read was still in flight depends on the disk, and the range must not come and go.
    Range range(s, io_names.wait_range);
    if (read->observed || completion_done(read->done)) {   // landed already: no stall
      moved = completion_wait(read->done);
    } else {
      const double start = perf_counter_s();
      std::exception_ptr error;
      try {
        wait_quietly(group_end(s, *read));   // NOTE [Wait for the group]
        moved = completion_wait(read->done);
      } catch (...) {
        error = std::current_exception();
      }
      add_stall(s, start, true, "wait read");
      if (error) std::rethrow_exception(error);
    }
  } catch (...) {
    observe(s, *read);
    read->memory.reset();   // a read that failed is over: its memory may go
    read->done.request.reset();
    throw;
  }
  observe(s, *read);
  // The read may stay in the FIFO until it reaches the front: it keeps nothing.
  std::shared_ptr<HostRegion> memory = std::move(read->memory);
  read->done.request.reset();
  s->read_bytes += moved;
  return hand_out(s, std::move(memory), read->skip, read->nbytes, dtype);
}

}  // namespace offload::bind::nvme

// The nvme tier's writes in flight, oldest first: batching, backpressure and retiring
// (nvme_transfers.hpp; NOTE [Write batches] and [Deferred free] there).
#include <Python.h>

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "bindings.hpp"
#include "error.hpp"
#include "nvme_transfers.hpp"
#include "perf_clock.hpp"
#include "py_calls.hpp"

namespace offload::bind::nvme {

namespace {

// Whether `write`'s storage keeps its bytes elsewhere than where the write reads them
// (NOTE [A source that moved]). Runs Python (the storage's `data_ptr`).
bool source_moved(const NvmeWrite& write) {
  if (write.source == nullptr || write.copy) return false;
  return static_cast<uintptr_t>(as_int(call_method(write.source, io_names.data_ptr))) !=
         write.address;
}

// Points `write` at a copy of its storage's bytes as they are now, at the payload's phase.
// Its callers run it right after `source_moved`, with nothing between that could run Python
// (`data_ptr` and `nbytes` are C methods of the storage): no nested submit can hand the
// write over in between.
void copy_moved_source(State* s, const NvmePayload* p, NvmeWrite* write) {
  const auto now = static_cast<uintptr_t>(as_int(call_method(write->source, io_names.data_ptr)));
  // A storage shrunk below the saved bytes (`resize_(0)`) gives what is left; autograd
  // raises for it in backward (records.py), so the zeros after it are never read.
  const auto left = static_cast<uint64_t>(as_int(call_method(write->source, io_names.nbytes)));
  const uint64_t room = p->nbytes + s->alignment;   // fits `nbytes` at any phase
  std::shared_ptr<HostRegion> memory = HostArena::create(room, false)->allocate(room);
  const auto base = reinterpret_cast<uintptr_t>(memory->data());
  char* to = memory->data() + (p->phase + s->alignment - base % s->alignment) % s->alignment;
  const uint64_t kept = std::min<uint64_t>(left, p->nbytes);
  if (kept > 0) std::memcpy(to, reinterpret_cast<const void*>(now), kept);
  if (kept < p->nbytes) std::memset(to + kept, 0, p->nbytes - kept);
  write->copy = std::move(memory);
  write->address = reinterpret_cast<uintptr_t>(to);
}

}  // namespace

void retire(State* s, NvmePayload* p) {
  std::shared_ptr<NvmeWrite> write = p->write;
  if (!write) return;
  if (!write->done.set()) submit(s);
  std::exception_ptr error;
  uint64_t written = 0;
  try {
    bool faulted = false;
    try {
      written = completion_wait(write->done);
    } catch (const IoError& e) {
      // The memory was unmapped while the engine read it (EFAULT): the storage moved, maybe
      // back to the same address (a resize there and back): written again, below.
      if (e.err() != EFAULT || write->source == nullptr || write->copy) throw;
      faulted = true;
    }
    // NOTE [A source that moved], while the engine wrote it: written again, from a copy.
    if (!p->released && s->store && p->extent && (faulted || source_moved(*write))) {
      copy_moved_source(s, p, write.get());
      std::shared_ptr<IoRequest> again = s->store->write_ptr(*p->extent, write->address, p->nbytes);
      write->done.request = again;   // what a retire on another thread waits for now
      Py_BEGIN_ALLOW_THREADS
      again->wait(std::nullopt);
      Py_END_ALLOW_THREADS
      written = again->result();
    }
  } catch (...) {
    error = std::current_exception();
  }
  // NOTE [A failed write stays failed] A write that failed (EIO, ENOSPC) is raised where it
  // is retired, which may be another tensor's pack or unpack polling the queue, and a user
  // may catch that and go on; the payload keeps the error, so its own read raises it too
  // rather than reading an extent that was never written. A released payload's failure is
  // nobody's: dropped.
  if (error && p->released) error = nullptr;
  if (error && !p->write_error) p->write_error = error;
  if (p->write == write) p->write.reset();   // the payload keeps nothing of a finished write
  s->direct_inflight -= write->direct_bytes;
  write->direct_bytes = 0;
  const double end = completion_end_s(write->done);
  s->write_busy.emplace_back(write->start_s, end);
  trace_io(s, true, write->nbytes, write->start_s, end);
  if (error) std::rethrow_exception(error);
  s->written_bytes += written;
}

// NOTE [Write batches]
void submit(State* s) {
  if (s->batch.empty()) return;
  Range range(s, io_names.write_range);   // (its Python runs before the batch is taken)
  {
    // NOTE [A source that moved]. Python runs here too, so each payload is held, and one a
    // nested submit took already (its write handed over) is left alone.
    std::vector<py::object> held;
    held.reserve(s->batch.size());
    for (PyObject* obj : s->batch) held.push_back(borrow(obj));
    for (const py::object& obj : held) {
      NvmePayload* p = as_payload(obj.ptr());
      std::shared_ptr<NvmeWrite> write = p->write;
      if (write && !write->done.set() && source_moved(*write)) copy_moved_source(s, p, write.get());
    }
  }
  if (s->batch.empty()) return;
  std::vector<const Extent*> extents;
  std::vector<uintptr_t> ptrs;
  std::vector<uint64_t> sizes;
  extents.reserve(s->batch.size());
  ptrs.reserve(s->batch.size());
  sizes.reserve(s->batch.size());
  for (PyObject* obj : s->batch) {
    NvmePayload* p = as_payload(obj);
    extents.push_back(p->extent.get());
    ptrs.push_back(p->write->address);
    sizes.push_back(p->nbytes);
  }
  // Throws before submitting any (a closed store): the batch stays, and so does the error
  // for whoever waits on one of its writes.
  const double submitted = perf_counter_s();
  std::vector<std::shared_ptr<IoRequest>> requests = s->store->write_ptr_many(extents, ptrs, sizes);
  std::vector<PyObject*> batch;
  batch.swap(s->batch);
  s->batch_bytes = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    NvmeWrite* write = as_payload(batch[i])->write.get();
    write->done.request = requests[i];
    // Its disk time starts here, not when it joined the batch: the compute between saves
    // that a batch waits through is no disk time (counted, `nvme_write_gbps` and the
    // round-trip plan, which learns the link from it, took the disk for a slow one).
    write->start_s = submitted;
  }
  for (PyObject* p : batch) Py_DECREF(p);
}

void append_write(State* s, NvmePayload* p, std::shared_ptr<NvmeWrite> write) {
  write->start_s = perf_counter_s();
  p->write = std::move(write);
  s->writes.push_back(Py_NewRef(reinterpret_cast<PyObject*>(p)));
  if (s->writes.size() > s->peak_writes) s->peak_writes = s->writes.size();
}

void retire_oldest(State* s, const std::function<bool()>& done, const char* what) {
  if (done() || s->writes.empty()) return;
  submit(s);
  const double start = perf_counter_s();
  while (!done() && !s->writes.empty()) {
    py::object p = steal(s->writes.front());
    s->writes.pop_front();
    retire(s, as_payload(p.ptr()));
  }
  add_stall(s, start, s->in_backward, what);
}

bool has_direct_room(const State* s, uint64_t nbytes) {
  // At most `direct_cap` bytes of source tensors held for their writes (a larger tensor
  // goes alone), the same RAM a staging arena would have used.
  return s->direct_inflight == 0 || s->direct_inflight + nbytes <= s->direct_cap;
}

void add_direct(State* s, NvmePayload* p, PyObject* source, uintptr_t address) {
  if (!s->store) raise_type_error("offload: direct writes need the core's NvmeStore");
  const uint64_t nbytes = p->nbytes;
  if (!has_direct_room(s, nbytes))
    retire_oldest(s, [s, nbytes] { return has_direct_room(s, nbytes); }, "wait write-behind");
  auto write = std::make_shared<NvmeWrite>(nbytes);
  write->source = Py_NewRef(source);
  write->address = address;
  write->direct_bytes = nbytes;
  s->direct_inflight += nbytes;
  append_write(s, p, std::move(write));
  s->batch.push_back(Py_NewRef(reinterpret_cast<PyObject*>(p)));
  s->batch_bytes += nbytes;
  if (s->batch.size() >= s->write_batch || s->batch_bytes >= s->batch_limit) submit(s);
}

void poll_writes(State* s) {
  while (!s->writes.empty()) {
    PyObject* front = s->writes.front();
    NvmePayload* p = as_payload(front);
    if (p->write) {
      if (!p->write->done.set()) return;   // batched
      py::object held = borrow(front);
      if (!completion_done(p->write->done)) return;
      if (s->writes.empty() || s->writes.front() != front) continue;   // (Python ran)
    }
    s->writes.pop_front();
    py::object p_ref = steal(front);
    retire(s, p);
  }
}

bool released_write_pending(const State* s) {
  for (PyObject* p : s->writes) {
    const NvmePayload* payload = as_payload(p);
    if (payload->released && payload->write) return true;
  }
  return false;
}

bool writes_pending(const State* s) {
  for (PyObject* p : s->writes)
    if (as_payload(p)->write) return true;   // retired entries linger
  return false;
}

void drain_writes(State* s) {
  submit(s);
  while (!s->writes.empty()) {
    py::object p = steal(s->writes.front());
    s->writes.pop_front();
    retire(s, as_payload(p.ptr()));
  }
}

}  // namespace offload::bind::nvme

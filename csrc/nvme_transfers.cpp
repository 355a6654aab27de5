// The nvme tier's transfers (nvme_transfers.hpp): their completions, the step's figures
// (stalls, trace spans, profiler ranges), a payload's allocation and release, closing.
#include <Python.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "nvme_transfers.hpp"
#include "perf_clock.hpp"
#include "py_calls.hpp"

namespace offload::bind::nvme {

IoNames io_names;

void init_io_names() {
  io_names = IoNames{intern("done"),       intern("wait"),
                     intern("end_s"),      intern("add_stall"),
                     intern("add"),        intern("tensor_for_use"),
                     intern("allocate"),   intern("release"),
                     intern("data_ptr"),   intern("nbytes"),
                     intern("span"),       intern("profiling"),
                     intern("WRITE"),      intern("WAIT_READ"),
                     intern("category"),   intern("args"),
                     intern("io"),         intern("bytes"),
                     nullptr,                   intern("nvme write"),
                     intern("nvme read"),  intern("trace"),
                     intern("enabled")};
  io_names.dtype_kw = PyTuple_Pack(1, intern("dtype"));
  if (io_names.dtype_kw == nullptr) throw py::error_already_set();
}

void raise_used_after_close(const char* message) {
  set_used_after_close(message);
  throw py::error_already_set();
}

void raise_type_error(const char* message) {
  PyErr_SetString(PyExc_TypeError, message);
  throw py::error_already_set();
}

void check_open(const State* s) {
  if (s->closed) raise_used_after_close(kUsedAfterClose);
}

// ------------------------------------------------------------------------ completions

void require_set(const Completion& c) {
  if (c.set()) return;
  PyErr_SetString(PyExc_RuntimeError, "offload: a transfer was waited on before it started");
  throw py::error_already_set();
}

bool completion_done(const Completion& c) {
  require_set(c);
  if (c.request) return c.request->done();
  py::object done = call_method(borrow(c.future).ptr(), io_names.done);
  const int truth = PyObject_IsTrue(done.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

uint64_t completion_wait(const Completion& c) {
  require_set(c);
  if (c.request) {
    std::shared_ptr<IoRequest> request = c.request;   // ours across the wait
    if (!request->done()) {
      Py_BEGIN_ALLOW_THREADS
      request->wait(std::nullopt);
      Py_END_ALLOW_THREADS
    }
    return request->result();
  }
  py::object future = borrow(c.future);
  return static_cast<uint64_t>(as_int(call_method(future.ptr(), io_names.wait)));
}

double completion_end_s(const Completion& c) {
  if (!c.set()) return perf_counter_s();
  if (c.request) {
    const auto end = c.request->end_s();
    return end ? *end : perf_counter_s();
  }
  PyObject* end = PyObject_GetAttr(c.future, io_names.end_s);
  if (end == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
    PyErr_Clear();
    return perf_counter_s();
  }
  py::object held = steal(end);
  if (end == Py_None) return perf_counter_s();
  const double value = PyFloat_AsDouble(end);
  if (value == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

Range::Range(const State* s, PyObject* name_attr) {
  if (profiler_on(s->profiling))
    open(attr(s->ranges, io_names.span).ptr(), attr(s->ranges, name_attr).ptr());
}

void add_stall(const State* s, double start_s, bool backward, const char* what) {
  py::object seconds = py::float_(perf_counter_s() - start_s);
  py::object start = py::float_(start_s);
  py::object label = py::str(what);
  PyObject* argv[] = {s->stats, seconds.ptr(), backward ? Py_True : Py_False, start.ptr(),
                      label.ptr()};
  PyObject* out = PyObject_VectorcallMethod(io_names.add_stall, argv,
                                            5 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
}

void trace_io(const State* s, bool write, uint64_t nbytes, double start_s, double end_s) {
  if (s->trace == nullptr) return;
  py::str name((write ? "write " : "read ") + std::to_string(nbytes) + " B");
  py::dict args;
  args[py::handle(io_names.bytes)] = py::int_(nbytes);
  py::dict kwargs;
  kwargs[py::handle(io_names.category)] = py::handle(io_names.io);
  kwargs[py::handle(io_names.args)] = args;
  py::handle track(write ? io_names.write_kind : io_names.read_kind);
  py::tuple positional = py::make_tuple(name, track, start_s, end_s);
  PyObject* add = PyObject_GetAttr(s->trace, io_names.add);
  if (add == nullptr) throw py::error_already_set();
  PyObject* out = PyObject_Call(add, positional.ptr(), kwargs.ptr());
  Py_DECREF(add);
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
}

void poll(State* s) {
  poll_writes(s);
  poll_reads(s);
}

void release(State* s, NvmePayload* p) {
  if (p->released) return;
  p->released = true;
  PyObject* obj = reinterpret_cast<PyObject*>(p);
  py::object live_ref;   // dropped last: the caller's reference keeps `p` meanwhile
  if (s->live.erase(obj) != 0) live_ref = steal(obj);
  if (s->closed) return;
  s->own_bytes -= static_cast<int64_t>(p->nbytes);
  if (p->write && !p->write->done.set()) submit(s);   // NOTE [Write batches]
  if (std::shared_ptr<NvmeRead> read = std::move(p->read)) {
    observe(s, *read);
    // NOTE [Deferred free]: a host read's request holds its memory (ours may go), a chained
    // read's ticket its block and destination until the copy is done. Kept until it lands
    // either way, so that a drained tier has nothing in flight and its space is back.
    read->memory.reset();
    if (!completion_done(read->done)) s->deferred.push_back(std::move(read));
  }
  if (p->foreign_extent != nullptr)
    call_method(p->foreign_extent, io_names.release);
  else if (p->extent)
    p->extent->release();
}

py::object allocate(State* s, uint64_t nbytes, PyObject* device, uint64_t phase, bool cuda) {
  check_open(s);
  if (nbytes == 0) {
    PyErr_SetString(PyExc_ValueError, "offload: NvmeTransfers.allocate: nbytes must be > 0");
    throw py::error_already_set();
  }
  std::shared_ptr<Extent> extent;
  py::object foreign;
  if (s->store) {
    std::shared_ptr<ExtentRange> range = s->store->allocate(nbytes, phase);
    if (!range && (released_write_pending(s) || !s->deferred.empty())) {
      // NOTE [Full while released I/O lands] A released payload gives its extent back at
      // once, but its request holds the range until the I/O ends (NOTE [Deferred free]):
      // after a graph dropped without backward (a skipped batch, a retry in smaller
      // pieces) the store looked full to the next forward while only one graph was
      // alive, and its saves stayed on the device (or raised TierFullError under strict).
      // Before answering "full", the released payloads' writes (and the older ones
      // queued before them) and reads in flight land, a stall like any wait for the disk.
      // Only this path waits, and only for I/O whose space it gives back: a store full of
      // live data answers at once, as before.
      retire_oldest(s, [s] { return !released_write_pending(s); }, "wait space");
      if (!s->deferred.empty()) {
        const double start = perf_counter_s();
        reap(s, true);
        add_stall(s, start, s->in_backward, "wait space");
      }
      range = s->store->allocate(nbytes, phase);
    }
    if (!range) return py::none();
    extent = std::make_shared<Extent>(std::move(range));
  } else {
    foreign = call_with(attr(s->store_obj, io_names.allocate).ptr(), py::int_(nbytes),
                        py::int_(phase));
    if (foreign.is_none()) return py::none();
  }
  py::object payload = steal(new_payload(nbytes, device, phase, cuda, std::move(extent),
                                         foreign ? foreign.ptr() : nullptr));
  if (!payload) throw py::error_already_set();
  s->own_bytes += static_cast<int64_t>(nbytes);   // from here on `release` gives it back
  s->live.insert(Py_NewRef(payload.ptr()));
  return payload;
}

py::object store_direct(State* s, PyObject* storage, PyObject* device) {
  check_open(s);
  poll(s);
  const auto address = static_cast<uint64_t>(as_int(call_method(storage, io_names.data_ptr)));
  const auto nbytes = static_cast<uint64_t>(as_int(call_method(storage, io_names.nbytes)));
  uint64_t phase = address % s->alignment;
  if (phase % 64 != 0) phase = 0;   // NOTE [Phase]: through the bounce buffer whole
  py::object payload = allocate(s, nbytes, device, phase, false);
  if (!payload.is_none()) add_direct(s, as_payload(payload.ptr()), storage, address);
  return payload;
}

void drain(State* s) {
  drain_writes(s);
  reap(s, true);
}

namespace {

// Waits for `c`, dropping its failure (nobody needs these bytes any more).
void wait_quietly(const Completion& c) {
  try {
    completion_wait(c);
  } catch (py::error_already_set&) {
  } catch (const std::exception&) {
  }
}

// Hands the batch to the engine, dropping a failure (a closed store): nobody waits for
// these bytes any more (wait_all, cancel_all).
void submit_quietly(State* s) {
  try {
    submit(s);
  } catch (py::error_already_set&) {
  } catch (const std::exception&) {
  }
}

}  // namespace

void wait_all(State* s) {
  submit_quietly(s);
  wait_submitted_writes(s);
  std::vector<std::shared_ptr<NvmeRead>> reads(s->deferred.begin(), s->deferred.end());
  for (const auto& read : s->reads)
    if (!read->observed) reads.push_back(read);
  for (const auto& read : reads) wait_quietly(read->done);
}

void cancel_all(State* s) {
  submit_quietly(s);   // (a batch the engine does not have yet would be handed over at release)
  const auto cancel = [](const Completion& c) {
    if (c.request) c.request->cancel();   // (a Python future or a device ticket runs on)
  };
  for (PyObject* p : s->writes)
    if (const auto& write = as_payload(p)->write) cancel(write->done);
  for (const auto& read : s->reads) cancel(read->done);
  for (const auto& read : s->deferred) cancel(read->done);
}

void wait_submitted_writes(State* s) {
  // A direct write's source is held only by its NvmeWrite (the engine takes no owner of
  // the memory it writes from): dropping one in flight frees memory the engine still reads.
  std::vector<std::shared_ptr<NvmeWrite>> writes;
  for (PyObject* p : s->writes) {
    const auto& write = as_payload(p)->write;
    if (write && write->done.set()) writes.push_back(write);
  }
  for (const auto& write : writes) wait_quietly(write->done);
}

void forget(State* s) {
  wait_submitted_writes(s);
  s->closed = true;
  s->store.reset();
  s->arena.reset();
  py::object store = steal(s->store_obj);   // dropped last, with the rest
  s->store_obj = Py_NewRef(Py_None);
  std::deque<PyObject*> writes;
  writes.swap(s->writes);
  std::vector<PyObject*> batch;
  batch.swap(s->batch);
  s->batch_bytes = 0;
  std::deque<std::shared_ptr<NvmeRead>> reads;
  reads.swap(s->reads);
  s->pending_reads = 0;
  std::vector<std::shared_ptr<NvmeRead>> deferred;
  deferred.swap(s->deferred);
  for (PyObject* p : writes) as_payload(p)->write.reset();
  for (PyObject* p : writes) Py_DECREF(p);
  for (PyObject* p : batch) Py_DECREF(p);
}

}  // namespace offload::bind::nvme

// The nvme tier's transfers as a Python class, NvmeTransfers (nvme_transfers.hpp has what
// they are and do): methods called per stored storage (store_direct, prefetch, fetch,
// release), the CUDA paths' finer steps, and the tier's lifecycle. Written against the C
// API with METH_FASTCALL: the tier calls these per saved tensor.
#include <Python.h>

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings.hpp"
#include "nvme_transfers.hpp"
#include "perf_clock.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"

namespace offload::bind {

using namespace nvme;

namespace {

struct Transfers {
  PyObject_HEAD
  State* s;
};

State* state(PyObject* self) { return reinterpret_cast<Transfers*>(self)->s; }

bool nargs_are(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "NvmeTransfers.%s takes %zd arguments (%zd given)", name, want,
               nargs);
  return false;
}

NvmePayload* payload_arg(const char* name, PyObject* obj) {
  if (is_payload(obj)) return as_payload(obj);
  PyErr_Format(PyExc_TypeError, "NvmeTransfers.%s: a payload must be an NvmePayload, not %s",
               name, Py_TYPE(obj)->tp_name);
  throw py::error_already_set();
}

uint64_t size_arg(const char* what, PyObject* obj) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "NvmeTransfers: %s must be an int, not %s", what,
                 Py_TYPE(obj)->tp_name);
    throw py::error_already_set();
  }
  const long long value = PyLong_AsLongLong(obj);
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (value < 0) {
    PyErr_Format(PyExc_ValueError, "NvmeTransfers: %s must be >= 0, got %lld", what, value);
    throw py::error_already_set();
  }
  return static_cast<uint64_t>(value);
}

#define FASTCALL(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn))

PyObject* m_store_direct(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("store_direct", nargs, 2)) return nullptr;
  return guarded([&] { return store_direct(state(self), a[0], a[1]).release().ptr(); });
}

PyObject* m_allocate(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("allocate", nargs, 4)) return nullptr;
  return guarded([&] {
    const int cuda = PyObject_IsTrue(a[3]);
    if (cuda < 0) throw py::error_already_set();
    return allocate(state(self), size_arg("nbytes", a[0]), a[1], size_arg("phase", a[2]),
                    cuda != 0).release().ptr();
  });
}

PyObject* m_add_direct(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("add_direct", nargs, 3)) return nullptr;
  return guarded([&] {
    add_direct(state(self), payload_arg("add_direct", a[0]), a[1], size_arg("address", a[2]));
    Py_RETURN_NONE;
  });
}

PyObject* m_add_chained(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("add_chained", nargs, 3)) return nullptr;
  return guarded([&] {
    NvmePayload* p = payload_arg("add_chained", a[0]);
    auto write = std::make_shared<NvmeWrite>(p->nbytes);
    write->done.future = Py_NewRef(a[1]);
    write->d2h = Py_NewRef(a[2]);
    append_write(state(self), p, std::move(write));
    Py_RETURN_NONE;
  });
}

PyObject* m_add_chained_read(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("add_chained_read", nargs, 2)) return nullptr;
  return guarded([&] {
    NvmePayload* p = payload_arg("add_chained_read", a[0]);
    auto read = std::make_shared<NvmeRead>(p->nbytes, true);
    read->start_s = perf_counter_s();
    read->done.future = Py_NewRef(a[1]);
    add_read(state(self), p, std::move(read));
    Py_RETURN_NONE;
  });
}

PyObject* m_retire_oldest(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("retire_oldest", nargs, 2)) return nullptr;
  return guarded([&] {
    PyObject* predicate = a[0];
    const char* what = PyUnicode_AsUTF8(a[1]);
    if (what == nullptr) throw py::error_already_set();
    std::string label(what);
    retire_oldest(state(self), [predicate] {
      py::object got = call(predicate);
      const int truth = PyObject_IsTrue(got.ptr());
      if (truth < 0) throw py::error_already_set();
      return truth != 0;
    }, label.c_str());
    Py_RETURN_NONE;
  });
}

PyObject* m_prefetch(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("prefetch", nargs, 1)) return nullptr;
  return guarded([&] {
    return Py_NewRef(prefetch(state(self), payload_arg("prefetch", a[0])) ? Py_True : Py_False);
  });
}

PyObject* m_before_read(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("before_read", nargs, 1)) return nullptr;
  return guarded([&] {
    check_open(state(self));
    before_read(state(self), payload_arg("before_read", a[0]));
    Py_RETURN_NONE;
  });
}

PyObject* m_start_read(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("start_read", nargs, 1)) return nullptr;
  return guarded([&] {
    if (start_host_read(state(self), payload_arg("start_read", a[0])) == ReadStart::released)
      raise_used_after_close(kFetchReleased);
    Py_RETURN_NONE;
  });
}

PyObject* m_fetch(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("fetch", nargs, 1)) return nullptr;
  return guarded([&] { return fetch(state(self), payload_arg("fetch", a[0])).release().ptr(); });
}

PyObject* m_pending_d2h(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("pending_d2h", nargs, 1)) return nullptr;
  return guarded([&] {
    NvmePayload* p = payload_arg("pending_d2h", a[0]);
    return Py_NewRef(p->write && p->write->d2h != nullptr ? p->write->d2h : Py_None);
  });
}

PyObject* m_release(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("release", nargs, 1)) return nullptr;
  return guarded([&] {
    release(state(self), payload_arg("release", a[0]));
    Py_RETURN_NONE;
  });
}

PyObject* m_poll(PyObject* self, PyObject*) {
  return guarded([&] {
    poll(state(self));
    Py_RETURN_NONE;
  });
}

PyObject* m_submit(PyObject* self, PyObject*) {
  return guarded([&] {
    submit(state(self));
    Py_RETURN_NONE;
  });
}

PyObject* m_drain(PyObject* self, PyObject*) {
  return guarded([&] {
    drain(state(self));
    Py_RETURN_NONE;
  });
}

PyObject* m_abort(PyObject* self, PyObject*) {
  return guarded([&] {
    State* s = state(self);
    cancel_all(s);
    std::vector<py::object> live;
    for (PyObject* p : s->live) live.push_back(borrow(p));
    for (const py::object& p : live) release(s, as_payload(p.ptr()));
    Py_RETURN_NONE;
  });
}

PyObject* m_wait_all(PyObject* self, PyObject*) {
  return guarded([&] {
    wait_all(state(self));
    Py_RETURN_NONE;
  });
}

PyObject* m_close(PyObject* self, PyObject*) {
  return guarded([&] {
    forget(state(self));
    Py_RETURN_NONE;
  });
}

PyObject* m_take_counts(PyObject* self, PyObject*) {
  return guarded([&] {
    State* s = state(self);
    // A call from inside this one (the collector frees something whose __del__ reads the
    // figures) takes nothing: the outer call takes what it copied, and no more.
    if (s->taking_counts)
      return py::make_tuple(0, 0, s->peak_writes, s->peak_reads, py::list(), py::list())
          .release().ptr();
    struct Taking {
      State* s;
      explicit Taking(State* st) : s(st) { s->taking_counts = true; }
      ~Taking() { s->taking_counts = false; }
    } taking(s);
    // Copies first: building the lists may run the collector, and a record it frees may
    // add to the figures (its release observes a read).
    const auto write_busy = s->write_busy;
    const auto read_busy = s->read_busy;
    const uint64_t written = s->written_bytes, read = s->read_bytes;
    py::list writes, reads;
    for (const auto& [start, end] : write_busy) writes.append(py::make_tuple(start, end));
    for (const auto& [start, end] : read_busy) reads.append(py::make_tuple(start, end));
    py::tuple out = py::make_tuple(written, read, s->peak_writes, s->peak_reads, writes, reads);
    // Taken out only once the result is built.
    s->write_busy.erase(s->write_busy.begin(), s->write_busy.begin() + write_busy.size());
    s->read_busy.erase(s->read_busy.begin(), s->read_busy.begin() + read_busy.size());
    s->written_bytes -= written;
    s->read_bytes -= read;
    return out.release().ptr();
  });
}

PyObject* g_own_bytes(PyObject* self, void*) { return PyLong_FromLongLong(state(self)->own_bytes); }

PyObject* g_idle(PyObject* self, void*) {
  const State* s = state(self);
  return Py_NewRef(!writes_pending(s) && s->pending_reads == 0 && s->deferred.empty() ? Py_True
                                                                                      : Py_False);
}

PyObject* g_writes_pending(PyObject* self, void*) {
  return Py_NewRef(writes_pending(state(self)) ? Py_True : Py_False);
}

PyObject* g_closed(PyObject* self, void*) {
  return Py_NewRef(state(self)->closed ? Py_True : Py_False);
}

PyObject* g_live(PyObject* self, void*) {
  PyObject* out = PySet_New(nullptr);
  if (out == nullptr) return nullptr;
  for (PyObject* p : state(self)->live) {
    if (PySet_Add(out, p) < 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

PyMethodDef methods[] = {
    {"store_direct", FASTCALL(m_store_direct), METH_FASTCALL,
     "store_direct(storage, device): a CPU storage's payload, written in place (batched); "
     "None when the store has no room."},
    {"allocate", FASTCALL(m_allocate), METH_FASTCALL,
     "allocate(nbytes, device, phase, cuda): a payload with its extent, no transfer yet; "
     "None when the store has no room."},
    {"add_direct", FASTCALL(m_add_direct), METH_FASTCALL,
     "add_direct(payload, source, address): write from host memory `source` (kept until "
     "the write is retired), batched; waits first while the direct-write cap is reached."},
    {"add_chained", FASTCALL(m_add_chained), METH_FASTCALL,
     "add_chained(payload, future, d2h): a write the engine starts after a device copy."},
    {"add_chained_read", FASTCALL(m_add_chained_read), METH_FASTCALL,
     "add_chained_read(payload, ticket): a read → H2D the engine runs (its H2DTicket)."},
    {"retire_oldest", FASTCALL(m_retire_oldest), METH_FASTCALL,
     "retire_oldest(done, what): retire writes oldest first until done(); a stall."},
    {"prefetch", FASTCALL(m_prefetch), METH_FASTCALL,
     "prefetch(payload): start a host read; False when one is in flight or landed, or the "
     "payload was released."},
    {"before_read", FASTCALL(m_before_read), METH_FASTCALL,
     "before_read(payload): submit the batch and retire the payload's own write."},
    {"start_read", FASTCALL(m_start_read), METH_FASTCALL,
     "start_read(payload): a host read into memory of the payload's phase."},
    {"fetch", FASTCALL(m_fetch), METH_FASTCALL,
     "fetch(payload): the bytes (a host read's as a uint8 tensor; a chained read's on the "
     "device); waits for this payload's read only."},
    {"pending_d2h", FASTCALL(m_pending_d2h), METH_FASTCALL,
     "pending_d2h(payload): the D2H ticket of its write still in flight, or None."},
    {"release", FASTCALL(m_release), METH_FASTCALL,
     "release(payload): give the extent back at once; never waits for I/O."},
    {"poll", m_poll, METH_NOARGS, "Retire landed writes, note landed reads, free deferred memory."},
    {"submit", m_submit, METH_NOARGS,
     "Hand the batched writes to the engine now (NOTE [Write batches]): the block is over."},
    {"drain", m_drain, METH_NOARGS, "Wait for every write, and for deferred reads."},
    {"abort", m_abort, METH_NOARGS,
     "Cancel every transfer not yet started, and release every payload not yet released."},
    {"wait_all", m_wait_all, METH_NOARGS,
     "Wait for every transfer in flight, dropping failures (a tier closing unclean)."},
    {"close", m_close, METH_NOARGS,
     "Drop every transfer's references; later stores and reads raise UsedAfterCloseError."},
    {"take_counts", m_take_counts, METH_NOARGS,
     "(written bytes, read bytes, peak writes in flight, peak reads in flight, write busy "
     "intervals, read busy intervals) since the last call (the peaks: so far)."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef getset[] = {
    {const_cast<char*>("own_bytes"), g_own_bytes, nullptr,
     const_cast<char*>("Bytes of this tier's payloads not yet released."), nullptr},
    {const_cast<char*>("idle"), g_idle, nullptr,
     const_cast<char*>("No write, read or deferred read in flight."), nullptr},
    {const_cast<char*>("writes_pending"), g_writes_pending, nullptr,
     const_cast<char*>("Some write not yet retired."), nullptr},
    {const_cast<char*>("closed"), g_closed, nullptr, nullptr, nullptr},
    {const_cast<char*>("live"), g_live, nullptr,
     const_cast<char*>("A set of the payloads not yet released."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// NvmeTransfers(store, arena, alignment, direct_cap_bytes, batch_bytes, write_batch, stats,
//               ranges, frombuffer, uint8)
PyObject* transfers_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"store",       "arena",      "alignment", "direct_cap_bytes",
                                   "batch_bytes", "write_batch", "stats",    "ranges",
                                   "frombuffer",  "uint8",      nullptr};
  PyObject *store, *arena, *stats, *ranges, *frombuffer, *uint8;
  unsigned long long alignment, direct_cap, batch_bytes, write_batch;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOKKKKOOOO", const_cast<char**>(keywords),
                                   &store, &arena, &alignment, &direct_cap, &batch_bytes,
                                   &write_batch, &stats, &ranges, &frombuffer, &uint8))
    return nullptr;
  if (alignment == 0 || write_batch == 0) {
    PyErr_SetString(PyExc_ValueError, "NvmeTransfers: alignment and write_batch must be > 0");
    return nullptr;
  }
  auto made = guarded([&]() -> PyObject* {
    auto s = std::make_unique<State>();
    try {
      s->store = py::cast<std::shared_ptr<NvmeStore>>(py::handle(store));
    } catch (py::cast_error&) {   // another store: used through Python calls
    }
    if (arena != Py_None) {
      try {
        s->arena = py::cast<std::shared_ptr<HostArena>>(py::handle(arena));
      } catch (py::cast_error&) {   // another arena: host reads use fresh memory
      }
    }
    py::object trace = attr(stats, io_names.trace);
    py::object enabled = attr(trace.ptr(), io_names.enabled);
    const int records = PyObject_IsTrue(enabled.ptr());
    if (records < 0) throw py::error_already_set();
    s->store_obj = Py_NewRef(store);
    s->stats = Py_NewRef(stats);
    s->trace = records ? trace.release().ptr() : nullptr;
    s->ranges = Py_NewRef(ranges);
    s->profiling = attr(ranges, io_names.profiling).release().ptr();
    s->frombuffer = Py_NewRef(frombuffer);
    s->uint8 = Py_NewRef(uint8);
    s->alignment = alignment;
    s->direct_cap = direct_cap > 0 ? direct_cap : 1;
    s->batch_limit = batch_bytes;
    s->write_batch = write_batch;
    PyObject* obj = type->tp_alloc(type, 0);
    if (obj == nullptr) return nullptr;
    reinterpret_cast<Transfers*>(obj)->s = s.release();
    return obj;
  });
  return made;
}

void transfers_dealloc(PyObject* obj) {
  State* s = reinterpret_cast<Transfers*>(obj)->s;
  if (s != nullptr) {
    PyObject *type, *value, *traceback;   // a dealloc keeps any error being raised
    PyErr_Fetch(&type, &value, &traceback);
    nvme::wait_submitted_writes(s);
    PyErr_Restore(type, value, traceback);
  }
  delete s;
  Py_TYPE(obj)->tp_free(obj);
}

PyTypeObject transfers_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.NvmeTransfers", sizeof(Transfers),
      "NvmeTransfers(store, arena, alignment, direct_cap_bytes, batch_bytes, write_batch, "
      "stats, ranges, frombuffer, uint8): every write and read in flight for one nvme "
      "tier's payloads (csrc/nvme_transfers.cpp).",
      transfers_new, transfers_dealloc);
  type.tp_methods = methods;
  type.tp_getset = getset;
  return type;
}();

}  // namespace

State* nvme::transfers_state(PyObject* obj) {
  return Py_TYPE(obj) == &transfers_type ? state(obj) : nullptr;
}

void bind_nvme_transfers(py::module_& m) {
  init_io_names();
  add_type(m, "NvmeTransfers", transfers_type);
}

}  // namespace offload::bind

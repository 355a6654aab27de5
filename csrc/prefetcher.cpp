// offload/runtime/prefetch.py's Prefetcher in C (prefetcher.hpp): every stored storage of a
// prefetchable tier is registered once at pack and fetched once (or more) at unpack, and
// each fetch tops the read-ahead up; in Python that was some six frames per saved tensor.
//
// Tracked by the garbage collector (it holds the step's tiers, which hold the step); one
// object per step, its registered payloads in a C++ vector the collector's walk visits.
// Its lock is a C++ mutex taken without holding the GIL when another thread has it: the
// thread holding it may need the GIL to finish (a tier's Python `prefetch`).
#include "prefetcher.hpp"

#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "bindings.hpp"
#include "nvme_payload.hpp"
#include "nvme_transfers.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// One registered payload, in pack order.
struct Entry {
  PyObject* tier;
  PyObject* payload;
  PyObject* transfers;   // a CPU nvme payload's NvmeTransfers (`tier.cpu_reads`), or null
  uint64_t nbytes;
};

struct Orders {
  std::vector<Entry> entries;
  std::unordered_map<PyObject*, Py_ssize_t> position;    // payload -> its entry
  std::unordered_map<Py_ssize_t, uint64_t> inflight;     // prefetched, not yet fetched
  std::mutex lock;   // unpack may run on autograd's device threads
};

struct Prefetcher {
  PyObject_HEAD
  long long budget_bytes;
  long long inflight_bytes;
  Py_ssize_t cursor;     // next position to prefetch (walking down); valid when has_cursor
  char has_cursor;
  PyObject* stats;       // the step's Stats: prefetch_hits / _misses, peak_prefetch_bytes
  PyObject* profiling;   // torch._C._autograd._profiler_enabled
  PyObject* span;        // util/ranges.span
  PyObject* span_name;   // util/ranges.PREFETCH
  Orders* orders;
};

struct Names {
  PyObject* prefetch;
  PyObject* fetch;
  PyObject* released;
  PyObject* prefetched;
  PyObject* nbytes;
  PyObject* cpu_reads;
  PyObject* hits;
  PyObject* misses;
  PyObject* peak;
};
Names n;

Prefetcher* as_prefetcher(PyObject* obj) { return reinterpret_cast<Prefetcher*>(obj); }

// The lock, taken without holding up a thread that needs the GIL to let go of it.
class Locked {
 public:
  explicit Locked(std::mutex& m) : lock_(m, std::defer_lock) { lock_releasing_gil(lock_); }

 private:
  std::unique_lock<std::mutex> lock_;
};

NvmePayload* fast(const Entry& e) {
  return e.transfers != nullptr ? reinterpret_cast<NvmePayload*>(e.payload) : nullptr;
}

bool truthy(const py::object& value) {
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

py::object tier_call(PyObject* name, const Entry& e) {
  PyObject* argv[] = {e.tier, e.payload};
  PyObject* out = PyObject_VectorcallMethod(name, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            nullptr);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// tier.prefetch(payload): True when a load was started (tiers/base.py).
bool start(const Entry& e) {
  if (NvmePayload* p = fast(e)) return nvme::prefetch(nvme::transfers_state(e.transfers), p);
  return truthy(tier_call(n.prefetch, e));
}

bool released(const Entry& e) {
  if (NvmePayload* p = fast(e)) return p->released;
  return truthy(tier_call(n.released, e));
}

bool prefetched(const Entry& e) {
  if (NvmePayload* p = fast(e)) return p->read != nullptr;
  return truthy(tier_call(n.prefetched, e));
}

void add_to(PyObject* stats, PyObject* name, long long delta) {
  py::object now = attr(stats, name);
  py::object next = py::reinterpret_steal<py::object>(PyLong_FromLongLong(as_int(now) + delta));
  if (!next || PyObject_SetAttr(stats, name, next.ptr()) < 0) throw py::error_already_set();
}

// A released payload prefetched before its fetch no longer holds read memory: stop
// counting it.
void prune(Prefetcher* self) {
  Orders& o = *self->orders;
  for (auto it = o.inflight.begin(); it != o.inflight.end();) {
    const Entry& e = o.entries[it->first];
    if (released(e) || !prefetched(e)) {
      self->inflight_bytes -= static_cast<long long>(it->second);
      it = o.inflight.erase(it);
    } else {
      ++it;
    }
  }
}

// prefetch.py `_issue`: read ahead below `pos` up to the budget (at least one).
void issue(Prefetcher* self, Py_ssize_t pos) {
  ProfilerRange range;   // util/ranges.py PREFETCH, while a profiler runs
  if (profiler_on(self->profiling)) range.open(self->span, self->span_name);
  Orders& o = *self->orders;
  if (!self->has_cursor || pos - 1 < self->cursor) {
    self->cursor = pos - 1;
    self->has_cursor = 1;
  }
  if (self->inflight_bytes >= self->budget_bytes) prune(self);
  while (self->cursor >= 0 &&
         (self->inflight_bytes < self->budget_bytes || o.inflight.empty())) {
    const Py_ssize_t at = self->cursor;
    self->cursor = at - 1;
    const Entry& e = o.entries[at];
    // False when it is loading or loaded already, or was released: skipped.
    if (start(e)) {
      o.inflight[at] = e.nbytes;
      self->inflight_bytes += static_cast<long long>(e.nbytes);
    }
  }
  if (self->inflight_bytes > as_int(attr(self->stats, n.peak))) {
    py::object peak = py::reinterpret_steal<py::object>(PyLong_FromLongLong(self->inflight_bytes));
    if (!peak || PyObject_SetAttr(self->stats, n.peak, peak.ptr()) < 0)
      throw py::error_already_set();
  }
}

py::object fetch(Prefetcher* self, PyObject* tier, PyObject* payload, PyObject* dtype) {
  nvme::State* reads = nullptr;   // a CPU nvme payload's: its bytes with no Python call
  py::object reads_owner;         // holds the transfers `reads` belongs to: Python that runs
  //                                 in the wait (stats, another thread) may clear our orders
  {
    Locked locked(self->orders->lock);
    Orders& o = *self->orders;
    auto found = o.position.find(payload);
    if (found != o.position.end()) {
      const Py_ssize_t pos = found->second;
      const Entry& entry = o.entries[pos];
      if (fast(entry) != nullptr) {
        reads = nvme::transfers_state(entry.transfers);
        reads_owner = py::reinterpret_borrow<py::object>(entry.transfers);
      }
      // `start` begins a load only when none is in flight or done (the caller checked
      // that the payload was not released): that is a miss.
      add_to(self->stats, start(entry) ? n.misses : n.hits, 1);
      auto inflight = o.inflight.find(pos);
      if (inflight != o.inflight.end()) {
        self->inflight_bytes -= static_cast<long long>(inflight->second);
        o.inflight.erase(inflight);
      }
      issue(self, pos);
    }
  }
  // Waited for outside the lock, as the tier's fetch: other threads may read ahead meanwhile.
  // The payload lives on (the caller's record holds it); its transfers, `reads_owner`.
  if (reads != nullptr) return nvme::fetch(reads, reinterpret_cast<NvmePayload*>(payload), dtype);
  PyObject* argv[] = {tier, payload};
  PyObject* out = PyObject_VectorcallMethod(n.fetch, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            nullptr);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

void clear_orders(Prefetcher* self) {
  Orders& o = *self->orders;
  std::vector<Entry> entries;
  {
    Locked locked(o.lock);
    entries.swap(o.entries);
    o.position.clear();
    o.inflight.clear();
    self->inflight_bytes = 0;
  }
  for (Entry& e : entries) {   // after the orders are empty: a payload's death may run code
    Py_XDECREF(e.tier);
    Py_XDECREF(e.payload);
    Py_XDECREF(e.transfers);
  }
}

#define FASTCALL(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn))

bool nargs_are(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "Prefetcher.%s takes %zd arguments (%zd given)", name, want,
               nargs);
  return false;
}

void add(Prefetcher* self, PyObject* tier, PyObject* payload) {
  Entry e{tier, payload, nullptr, 0};
  if (is_payload(payload) && !reinterpret_cast<NvmePayload*>(payload)->cuda) {
    // The tier's `cpu_reads` (tiers/base.py): absent or None, its own methods.
    PyObject* reads = PyObject_GetAttr(tier, n.cpu_reads);
    if (reads == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
      PyErr_Clear();
    } else {
      if (nvme::transfers_state(reads) != nullptr) e.transfers = reads;   // the tier holds it
      Py_DECREF(reads);
    }
    e.nbytes = reinterpret_cast<NvmePayload*>(payload)->nbytes;
  } else {
    const long long nbytes = as_int(attr(payload, n.nbytes));
    e.nbytes = nbytes > 0 ? static_cast<uint64_t>(nbytes) : 0;
  }
  Locked locked(self->orders->lock);
  Orders& o = *self->orders;
  Py_INCREF(tier);
  Py_INCREF(payload);
  Py_XINCREF(e.transfers);
  o.position[payload] = static_cast<Py_ssize_t>(o.entries.size());
  o.entries.push_back(e);
}

PyObject* m_register(PyObject* obj, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("register", nargs, 2)) return nullptr;
  return guarded([&] {
    add(as_prefetcher(obj), a[0], a[1]);
    Py_RETURN_NONE;
  });
}

PyObject* m_fetch(PyObject* obj, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_are("fetch", nargs, 2)) return nullptr;
  return prefetcher_fetch(obj, a[0], a[1]);
}

PyObject* m_start(PyObject* obj, PyObject*) {
  return guarded([&] {
    Prefetcher* self = as_prefetcher(obj);
    Locked locked(self->orders->lock);
    if (!self->has_cursor && !self->orders->entries.empty())
      issue(self, static_cast<Py_ssize_t>(self->orders->entries.size()));
    Py_RETURN_NONE;
  });
}

PyObject* m_raise_budget(PyObject* obj, PyObject* arg) {
  return guarded([&] {
    const long long nbytes = as_int(py::reinterpret_borrow<py::object>(arg));
    Prefetcher* self = as_prefetcher(obj);
    Locked locked(self->orders->lock);
    if (nbytes > self->budget_bytes) self->budget_bytes = nbytes;
    Py_RETURN_NONE;
  });
}

PyObject* m_prune(PyObject* obj, PyObject*) {
  return guarded([&] {
    Prefetcher* self = as_prefetcher(obj);
    Locked locked(self->orders->lock);
    prune(self);
    Py_RETURN_NONE;
  });
}

PyObject* m_clear(PyObject* obj, PyObject*) {
  clear_orders(as_prefetcher(obj));
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register", FASTCALL(m_register), METH_FASTCALL,
     "register(tier, payload): a prefetchable payload's place in pack order."},
    {"fetch", FASTCALL(m_fetch), METH_FASTCALL,
     "fetch(tier, payload): its bytes (waiting only for them) after queueing read-ahead "
     "behind it."},
    {"start", m_start, METH_NOARGS,
     "start(): backward began: read ahead from the last payload packed."},
    {"raise_budget", m_raise_budget, METH_O,
     "raise_budget(nbytes): read ahead at least `nbytes` from now on."},
    {"_prune", m_prune, METH_NOARGS,
     "_prune(): stop counting prefetched payloads released before their fetch."},
    {"clear", m_clear, METH_NOARGS, "clear(): forget every payload."},
    {nullptr, nullptr, 0, nullptr},
};

PyObject* g_inflight_bytes(PyObject* obj, void*) {
  return PyLong_FromLongLong(as_prefetcher(obj)->inflight_bytes);
}

PyGetSetDef getset[] = {
    {const_cast<char*>("inflight_bytes"), g_inflight_bytes, nullptr,
     const_cast<char*>("Bytes prefetched and not yet fetched."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMemberDef members[] = {
    {const_cast<char*>("budget_bytes"), T_LONGLONG, offsetof(Prefetcher, budget_bytes),
     READONLY, const_cast<char*>("Bytes read ahead (raise_budget raises it).")},
    {nullptr, 0, 0, 0, nullptr},
};

PyObject* prefetcher_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"budget_bytes", "stats", "profiling", "span", "span_name",
                                   nullptr};
  long long budget;
  PyObject *stats, *profiling, *span, *span_name;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LOOOO", const_cast<char**>(keywords), &budget,
                                   &stats, &profiling, &span, &span_name))
    return nullptr;
  PyObject* obj = type->tp_alloc(type, 0);
  if (obj == nullptr) return nullptr;
  Prefetcher* self = as_prefetcher(obj);
  self->orders = new (std::nothrow) Orders();
  if (self->orders == nullptr) {
    Py_DECREF(obj);
    return PyErr_NoMemory();
  }
  self->budget_bytes = budget;
  self->stats = Py_NewRef(stats);
  self->profiling = Py_NewRef(profiling);
  self->span = Py_NewRef(span);
  self->span_name = Py_NewRef(span_name);
  return obj;
}

int prefetcher_traverse(PyObject* obj, visitproc visit, void* arg) {
  Prefetcher* self = as_prefetcher(obj);
  Py_VISIT(self->stats);
  if (self->orders != nullptr)
    for (const Entry& e : self->orders->entries) {
      Py_VISIT(e.tier);
      Py_VISIT(e.payload);
      Py_VISIT(e.transfers);
    }
  return 0;
}

int prefetcher_clear(PyObject* obj) {
  Prefetcher* self = as_prefetcher(obj);
  if (self->orders != nullptr) clear_orders(self);
  Py_CLEAR(self->stats);
  return 0;
}

void prefetcher_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  Prefetcher* self = as_prefetcher(obj);
  if (self->orders != nullptr) {
    clear_orders(self);
    delete self->orders;
    self->orders = nullptr;
  }
  Py_CLEAR(self->stats);
  Py_CLEAR(self->profiling);
  Py_CLEAR(self->span);
  Py_CLEAR(self->span_name);
  Py_TYPE(obj)->tp_free(obj);
}

PyTypeObject prefetcher_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.Prefetcher", sizeof(Prefetcher),
      "Prefetcher(budget_bytes, stats, profiling, span, span_name): the backward's "
      "read-ahead (offload/runtime/prefetch.py's, in C).",
      prefetcher_new, prefetcher_dealloc);
  tracked(type, prefetcher_traverse, prefetcher_clear);
  type.tp_methods = methods;
  type.tp_getset = getset;
  type.tp_members = members;
  return type;
}();

}  // namespace

bool is_prefetcher(PyObject* obj) { return Py_TYPE(obj) == &prefetcher_type; }

bool prefetcher_register(PyObject* obj, PyObject* tier, PyObject* payload) {
  PyObject* done = guarded([&] {
    add(as_prefetcher(obj), tier, payload);
    Py_RETURN_NONE;
  });
  Py_XDECREF(done);
  return done != nullptr;
}

PyObject* prefetcher_fetch(PyObject* obj, PyObject* tier, PyObject* payload, PyObject* dtype) {
  return guarded([&] { return fetch(as_prefetcher(obj), tier, payload, dtype).release().ptr(); });
}

void bind_prefetcher(py::module_& m) {
  n = {intern("prefetch"),    intern("fetch"),         intern("released"),
       intern("prefetched"),  intern("nbytes"),        intern("cpu_reads"),
       intern("prefetch_hits"), intern("prefetch_misses"), intern("peak_prefetch_bytes")};
  add_type(m, "Prefetcher", prefetcher_type);
}

}  // namespace offload::bind

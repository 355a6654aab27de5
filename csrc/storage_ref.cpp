// tiers/host.py's payload for a CPU storage: the storage's bytes held by reference (on a
// CPU run host RAM is the device's memory, so nothing is copied).
//
// Why C: the host tier makes one for every storage it stores on a CPU run, and a Python
// payload is an object the garbage collector walks again and again while the step holds it
// (~1-2 us per object over its life: docs/benchmarks.md *Hook cost*). This type is not
// tracked (no Py_TPFLAGS_HAVE_GC), which is safe: it refers only to a storage and a
// device, neither of which refers to anything of the user's, so no cycle can run through
// it. Same fields as a Python `Payload` (`nbytes`, `device`, `resident`) plus `storage`,
// which the tier sets to None when it releases the bytes.
//
// HostLedger: the host tier's byte count and its live StorageRefs, so that the core's
// packer can store a CPU activation in the host tier without a Python frame (its `store`
// is the tier's `store_cpu`: hooks.py NOTE [Move path in C]). The tier's Python code
// counts its pinned copies through the same ledger (`take` / `give`): one count, one
// capacity, whichever path stored.
#include "storage_ref.hpp"

#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include <unordered_set>
#include <vector>

#include "bindings.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct StorageRef {
  PyObject_HEAD
  PyObject* storage;   // None once released
  Py_ssize_t nbytes;
  PyObject* device;    // where the bytes came from and go back to
  PyObject* weakrefs;
};

PyObject* make(PyTypeObject* type, PyObject* storage, Py_ssize_t nbytes, PyObject* device) {
  PyObject* self_obj = type->tp_alloc(type, 0);
  if (self_obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<StorageRef*>(self_obj);
  self->storage = Py_NewRef(storage);
  self->nbytes = nbytes;
  self->device = Py_NewRef(device);
  return self_obj;
}

// `StorageRef(storage, nbytes, device)`, by position only: the tier makes one per storage,
// without an argument tuple.
PyObject* storage_ref_vectorcall(PyObject* type_obj, PyObject* const* args, size_t nargsf,
                                 PyObject* kwnames) {
  auto* type = reinterpret_cast<PyTypeObject*>(type_obj);
  if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "offload: StorageRef(storage, nbytes, device) takes "
                                     "its 3 arguments by position");
    return nullptr;
  }
  const Py_ssize_t nbytes = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
  if (nbytes == -1 && PyErr_Occurred()) return nullptr;
  return make(type, args[0], nbytes, args[2]);
}

void storage_ref_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<StorageRef*>(self_obj);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(self_obj);
  Py_CLEAR(self->storage);
  Py_CLEAR(self->device);
  Py_TYPE(self_obj)->tp_free(self_obj);
}

PyMemberDef storage_ref_members[] = {
    {const_cast<char*>("storage"), T_OBJECT, offsetof(StorageRef, storage), 0,
     const_cast<char*>("The storage; None once the tier released it.")},
    {const_cast<char*>("nbytes"), T_PYSSIZET, offsetof(StorageRef, nbytes), READONLY, nullptr},
    {const_cast<char*>("device"), T_OBJECT, offsetof(StorageRef, device), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject storage_ref_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.StorageRef", sizeof(StorageRef),
      "StorageRef(storage, nbytes, device): a CPU storage's bytes held by reference (the "
      "host tier's payload on a CPU run; `resident`: its bytes stay in the device's memory).",
      nullptr, storage_ref_dealloc);
  type.tp_vectorcall = storage_ref_vectorcall;
  type.tp_members = storage_ref_members;
  type.tp_weaklistoffset = offsetof(StorageRef, weakrefs);
  return type;
}();

// ------------------------------------------------------------------------- HostLedger

struct HostLedger {
  PyObject_HEAD
  long long capacity;
  long long used;
  // The StorageRefs stored and not yet released (a strong reference each; `abort`
  // releases them). Not tracked: a StorageRef refers to no Python object of the user's.
  std::unordered_set<PyObject*>* live;
  // The process's host budget (another HostLedger, holding no refs: tiers/host_budget.py NOTE
  // [One host budget]) that this tier's bytes count into too, and whose capacity they fit
  // into; null for a ledger of its own. `detach` lets go of it.
  PyObject* budget;
  long long ledgers;   // as a budget: the ledgers that count into it (attached, not detached)
};

PyObject* n_nbytes = nullptr;

HostLedger* as_ledger(PyObject* obj) { return reinterpret_cast<HostLedger*>(obj); }

bool parse_nbytes(PyObject* arg, long long* out) {
  *out = PyLong_AsLongLong(arg);
  if (*out == -1 && PyErr_Occurred()) return false;
  if (*out < 0) {
    PyErr_Format(PyExc_ValueError, "offload: HostLedger: nbytes must be >= 0, got %lld", *out);
    return false;
  }
  return true;
}

// Counts `nbytes` if they fit the capacity (both >= 0, used <= capacity: no overflow).
bool take(HostLedger* self, long long nbytes) {
  HostLedger* fits = self->budget != nullptr ? as_ledger(self->budget) : self;
  if (nbytes > fits->capacity - fits->used) return false;
  fits->used += nbytes;
  if (fits != self) self->used += nbytes;
  return true;
}

// This ledger's bytes leave its budget, which it lets go of.
void detach(HostLedger* self) {
  if (self->budget == nullptr) return;
  auto* budget = as_ledger(self->budget);
  budget->used -= self->used;
  --budget->ledgers;
  Py_CLEAR(self->budget);
}

// Uncounts `nbytes` this ledger counted (and its budget with it).
void uncount(HostLedger* self, long long nbytes) {
  self->used -= nbytes;
  if (self->budget != nullptr) as_ledger(self->budget)->used -= nbytes;
}

PyObject* ledger_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"capacity_bytes", "budget", nullptr};
  long long capacity;
  PyObject* budget = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|O", const_cast<char**>(keywords), &capacity,
                                   &budget))
    return nullptr;
  if (budget != Py_None && (Py_TYPE(budget) != type || as_ledger(budget)->budget != nullptr)) {
    PyErr_Format(PyExc_TypeError, "offload: HostLedger(budget=...) takes a HostLedger that has "
                 "no budget of its own, not %s", Py_TYPE(budget)->tp_name);
    return nullptr;
  }
  if (capacity < 0) {
    PyErr_Format(PyExc_ValueError, "offload: HostLedger: capacity_bytes must be >= 0, got %lld",
                 capacity);
    return nullptr;
  }
  PyObject* obj = type->tp_alloc(type, 0);
  if (obj == nullptr) return nullptr;
  auto* self = as_ledger(obj);
  self->capacity = capacity;
  self->used = 0;
  self->budget = budget == Py_None ? nullptr : Py_NewRef(budget);
  self->ledgers = 0;
  if (self->budget != nullptr) ++as_ledger(self->budget)->ledgers;
  self->live = new (std::nothrow) std::unordered_set<PyObject*>();
  if (self->live == nullptr) {
    Py_DECREF(obj);
    return PyErr_NoMemory();
  }
  return obj;
}

void ledger_dealloc(PyObject* obj) {
  auto* self = as_ledger(obj);
  if (self->live != nullptr) {
    std::vector<PyObject*> refs(self->live->begin(), self->live->end());
    delete self->live;
    self->live = nullptr;
    for (PyObject* ref : refs) Py_DECREF(ref);
  }
  detach(self);   // what it still counted leaves the budget with it
  Py_TYPE(obj)->tp_free(obj);
}

// store(storage, device): a StorageRef of the CPU storage, counted; None when it does not
// fit (the tier is full: the caller spills).
PyObject* ledger_store(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "offload: HostLedger.store(storage, device) takes 2 "
                 "arguments (%zd given)", nargs);
    return nullptr;
  }
  auto* self = as_ledger(obj);
  return guarded([&]() -> PyObject* {
    const long long nbytes = as_int(call_method(args[0], n_nbytes));
    if (!take(self, nbytes)) Py_RETURN_NONE;
    PyObject* ref = make(&storage_ref_type, args[0], static_cast<Py_ssize_t>(nbytes), args[1]);
    if (ref == nullptr) {
      uncount(self, nbytes);
      throw py::error_already_set();
    }
    self->live->insert(Py_NewRef(ref));
    return ref;
  });
}

// Uncounts a StorageRef's bytes and lets go of its storage (once).
void release_ref(HostLedger* self, PyObject* ref) {
  auto* fields = reinterpret_cast<StorageRef*>(ref);
  if (fields->storage == nullptr || fields->storage == Py_None) return;   // released
  PyObject* storage = fields->storage;
  fields->storage = Py_NewRef(Py_None);
  uncount(self, fields->nbytes);
  auto found = self->live->find(ref);
  if (found != self->live->end()) {
    self->live->erase(found);
    Py_DECREF(ref);   // the caller's reference keeps it meanwhile
  }
  Py_DECREF(storage);
}

PyObject* ledger_release(PyObject* obj, PyObject* ref) {
  if (Py_TYPE(ref) != &storage_ref_type) {
    PyErr_Format(PyExc_TypeError, "offload: HostLedger.release takes a StorageRef, not %s",
                 Py_TYPE(ref)->tp_name);
    return nullptr;
  }
  release_ref(as_ledger(obj), ref);
  Py_RETURN_NONE;
}

// take(nbytes) -> bool: counts bytes stored elsewhere (the tier's pinned copies) if they fit.
PyObject* ledger_take(PyObject* obj, PyObject* arg) {
  long long nbytes;
  if (!parse_nbytes(arg, &nbytes)) return nullptr;
  return PyBool_FromLong(take(as_ledger(obj), nbytes));
}

// give(nbytes): uncounts what `take` counted.
PyObject* ledger_give(PyObject* obj, PyObject* arg) {
  long long nbytes;
  if (!parse_nbytes(arg, &nbytes)) return nullptr;
  auto* self = as_ledger(obj);
  if (nbytes > self->used) {
    PyErr_Format(PyExc_ValueError, "offload: HostLedger.give(%lld) with only %lld bytes "
                 "counted", nbytes, self->used);
    return nullptr;
  }
  uncount(self, nbytes);
  Py_RETURN_NONE;
}

// detach(): this ledger's bytes leave its budget, which it lets go of (its tier closed:
// whatever it still counts is no longer the process's).
PyObject* ledger_detach(PyObject* obj, PyObject*) {
  detach(as_ledger(obj));
  Py_RETURN_NONE;
}

// abort(): releases every StorageRef not yet released.
PyObject* ledger_abort(PyObject* obj, PyObject*) {
  auto* self = as_ledger(obj);
  std::vector<PyObject*> refs(self->live->begin(), self->live->end());
  for (PyObject* ref : refs) Py_INCREF(ref);
  for (PyObject* ref : refs) {
    release_ref(self, ref);
    Py_DECREF(ref);
  }
  Py_RETURN_NONE;
}

PyObject* ledger_used(PyObject* obj, void*) { return PyLong_FromLongLong(as_ledger(obj)->used); }

PyObject* ledger_capacity(PyObject* obj, void*) {
  auto* self = as_ledger(obj);
  return PyLong_FromLongLong(self->budget != nullptr ? as_ledger(self->budget)->capacity
                                                     : self->capacity);
}

PyObject* ledger_ledgers(PyObject* obj, void*) {
  return PyLong_FromLongLong(as_ledger(obj)->ledgers);
}

PyObject* ledger_budget(PyObject* obj, void*) {
  PyObject* budget = as_ledger(obj)->budget;
  return Py_NewRef(budget != nullptr ? budget : Py_None);
}

Py_ssize_t ledger_len(PyObject* obj) {
  return static_cast<Py_ssize_t>(as_ledger(obj)->live->size());
}

PyMethodDef ledger_methods[] = {
    {"store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ledger_store)),
     METH_FASTCALL,
     "store(storage, device): a StorageRef of the CPU storage, its bytes counted; None when "
     "they do not fit (the host tier's `store_cpu`)."},
    {"release", ledger_release, METH_O,
     "release(ref): uncount a StorageRef's bytes and drop its storage (once)."},
    {"take", ledger_take, METH_O,
     "take(nbytes) -> bool: count bytes stored elsewhere (pinned copies) if they fit."},
    {"give", ledger_give, METH_O, "give(nbytes): uncount what take counted."},
    {"abort", ledger_abort, METH_NOARGS, "abort(): release every StorageRef still held."},
    {"detach", ledger_detach, METH_NOARGS,
     "detach(): uncount this ledger's bytes from its budget and let go of it."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef ledger_getset[] = {
    {const_cast<char*>("used_bytes"), ledger_used, nullptr,
     const_cast<char*>("Bytes this ledger counted (stored by reference, or taken)."), nullptr},
    {const_cast<char*>("capacity_bytes"), ledger_capacity, nullptr,
     const_cast<char*>("What `store` and `take` fit into (the budget's, with one)."), nullptr},
    {const_cast<char*>("budget"), ledger_budget, nullptr,
     const_cast<char*>("The HostLedger this one counts into too (None: none)."), nullptr},
    {const_cast<char*>("ledgers"), ledger_ledgers, nullptr,
     const_cast<char*>("As a budget: how many ledgers count into it now."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PySequenceMethods ledger_sequence = length_only(ledger_len);

PyTypeObject host_ledger_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.HostLedger", sizeof(HostLedger),
      "HostLedger(capacity_bytes, budget=None): the host tier's byte count and the "
      "StorageRefs it holds (`len`: how many are not yet released); with `budget` (a "
      "HostLedger) its bytes count into that one too and fit into its capacity.",
      ledger_new, ledger_dealloc);
  type.tp_methods = ledger_methods;
  type.tp_getset = ledger_getset;
  type.tp_as_sequence = &ledger_sequence;
  return type;
}();

}  // namespace

bool is_storage_ref(PyObject* obj) { return Py_TYPE(obj) == &storage_ref_type; }

void bind_storage_ref(py::module_& m) {
  n_nbytes = intern("nbytes");
  add_type(m, "HostLedger", host_ledger_type);
  add_type(m, "StorageRef", storage_ref_type);
  // A class attribute, as Payload.resident: the bytes still occupy the device's memory.
  if (PyDict_SetItemString(storage_ref_type.tp_dict, "resident", Py_True) < 0)
    throw py::error_already_set();
  PyType_Modified(&storage_ref_type);
}

}  // namespace offload::bind

// records.Record in C: one stored storage of a step (offload/runtime/records.py).
//
// Why C (offload/runtime/hooks.py NOTE [Handles in C]): a record is made for every storage
// the hooks store, and a Python one is an object the garbage collector walks again and
// again while the step holds it (~1-2 us per object over its life). This type is not
// tracked (no Py_TPFLAGS_HAVE_GC), which is safe for the reason the handles are: only the
// saves of its storage hold a record (the index refers to it weakly), and they are held
// by autograd alone, so any cycle through a record runs through an autograd node, whose
// references the collector cannot see whatever the record's type. Its fields are plain
// member slots (read and written from Python at slot speed); its logic (loading, the
// unpack cache) stays in records.py, which works on either record type, but for a CPU nvme
// payload's load, which record_load.cpp makes in C. What it holds is counted in its
// step's SavedBytes meter without a Python call (its resident bytes; whether it holds tier
// space), and at its death it gives its payload back to its tier itself.
//
// Written against the CPython API, not pybind11: member descriptors cost what __slots__
// cost (a pybind11 property is several times that, on the unpack path), and the type must
// support weak references and give its payload back as it dies.
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <new>

#include "bindings.hpp"
#include "perf_clock.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "saved_bytes.hpp"
#include "saved_record.hpp"
#include "timeline.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct Record {
  PyObject_HEAD
  // The storage (what `record()` returns, and what the storage index checks a hit with):
  // held strongly when the record's saves or its payload hold it anyway (kept, or
  // resident), so no weak reference is made; weakly when its bytes moved out.
  PyObject* storage_ref;
  char holds_storage;
  PyObject* tier;          // None when kept
  PyObject* payload;       // the tier's handle, None when kept
  Py_ssize_t nbytes;
  char resident;           // the bytes still occupy the device's memory
  PyObject* meta;          // a snapshot's layout (tensor_meta NOTE [Untracked aliases])
  PyObject* meter;         // the step's SavedBytes: counted in when made, out when freed
  SavedBytes* counts;      // ... its C++ object (alive while `meter` is held)
  PyObject* prefetcher;    // set when the tier's reloads are worth starting early
  UnpackCache unpack;      // records.py NOTE [Unpack cache] (saved_record.hpp)
  PyObject* timeline;      // the step's Timeline, when this storage is timed
  Py_ssize_t row;          // ... and its row there
  Py_ssize_t version;      // set by the StorageIndex: the version it was stored at
  PyObject* weakrefs;
  // The index entry naming this record, if any (constructed in record_new).
  std::weak_ptr<IndexEntries> index;
  PyObject* index_key;
};

// Whether `storage` is the storage this record was made for (and still lives).
bool names_storage(const Record* record, PyObject* storage) {
  if (record->storage_ref == nullptr) return false;
  if (record->holds_storage) return record->storage_ref == storage;
  return PyWeakref_GetObject(record->storage_ref) == storage;
}

// Take `record`'s entry out of the index that names it, if any (it dies, or enters another).
void leave_index(Record* record) {
  if (auto entries = record->index.lock()) {
    auto it = entries->map.find(record->index_key);
    if (it != entries->map.end() && it->second == reinterpret_cast<PyObject*>(record))
      entries->map.erase(it);
  }
}

PyObject* record_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* self = PyType_GenericNew(type, args, kwargs);   // zero-filled fields
  if (self != nullptr) new (&reinterpret_cast<Record*>(self)->index) std::weak_ptr<IndexEntries>();
  return self;
}

PyObject* release_name = nullptr;   // "release", interned

// records.py NOTE [Record lifetime]: a dying record gives its payload back to its tier,
// `tier.release(payload)`, under its meter's release lock (records die on whatever thread
// autograd drops them; the lock is waited for without the GIL, which its holder may need
// to finish). An error is swallowed: interpreter shutdown or a closed tier, nothing left to
// free.
void give_back(Record* self) {
  std::unique_lock<std::recursive_mutex> lock(self->counts->release_lock(), std::defer_lock);
  try {
    lock_releasing_gil(lock);
  } catch (...) {   // std::system_error: never seen; nothing may leave a dealloc
    return;
  }
  PyObject* done = PyObject_CallMethodOneArg(self->tier, release_name, self->payload);
  if (done == nullptr) PyErr_Clear();
  Py_XDECREF(done);
}

// Fills a new record's fields (its construction, by either call below). -1 with a Python
// error set when `meter` is not the core's SavedBytes.
int record_setup(Record* self, PyObject* storage, PyObject* tier, PyObject* payload,
                 Py_ssize_t nbytes, bool resident, PyObject* meta, PyObject* meter,
                 PyObject* prefetcher) {
  if (self->storage_ref != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: a Record is initialised once");
    return -1;
  }
  SavedBytes* counts = nullptr;
  try {
    counts = py::cast<SavedBytes*>(py::handle(meter));
  } catch (py::cast_error&) {
  }
  if (counts == nullptr) {   // not a SavedBytes, or None (which pybind11 casts to null)
    PyErr_Format(PyExc_TypeError, "offload: the core's Record counts into the core's "
                 "SavedBytes meter, not %s", Py_TYPE(meter)->tp_name);
    return -1;
  }
  self->holds_storage = payload == Py_None || resident;
  if (self->holds_storage) {
    self->storage_ref = Py_NewRef(storage);
  } else {
    self->storage_ref = untracked_weakref(storage);
    if (self->storage_ref == nullptr) return -1;
  }
  self->tier = Py_NewRef(tier);
  self->payload = Py_NewRef(payload);
  self->nbytes = nbytes;
  self->resident = static_cast<char>(resident);
  self->meta = Py_NewRef(meta);
  self->prefetcher = Py_NewRef(prefetcher);
  self->unpack.cache = Py_NewRef(Py_None);
  self->unpack.shared = Py_NewRef(Py_None);
  self->unpack.handed = nullptr;
  self->timeline = Py_NewRef(Py_None);
  self->row = -1;
  self->version = -1;
  // The meter last: a record counted in is one counted out (dealloc).
  try {
    counts->record_made(nbytes, resident, payload != Py_None ? tier : nullptr);
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return -1;
  }
  self->meter = Py_NewRef(meter);
  self->counts = counts;
  return 0;
}

int record_init(PyObject* self_obj, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"storage", "tier",  "payload",    "nbytes", "resident",
                                   "meta",    "meter", "prefetcher", nullptr};
  PyObject *storage, *tier, *payload, *meta, *meter, *prefetcher;
  Py_ssize_t nbytes;
  int resident;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnpOOO", const_cast<char**>(keywords),
                                   &storage, &tier, &payload, &nbytes, &resident, &meta,
                                   &meter, &prefetcher))
    return -1;
  return record_setup(reinterpret_cast<Record*>(self_obj), storage, tier, payload, nbytes,
                      resident != 0, meta, meter, prefetcher);
}

// `Record(...)` with its 8 arguments by position, as the hooks make one per stored storage:
// without the argument tuple and keyword parsing of __new__ / __init__ (the type's
// vectorcall). Any other call takes that way.
PyObject* record_vectorcall(PyObject* type_obj, PyObject* const* args, size_t nargsf,
                            PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 8 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyObject* tuple = PyTuple_New(nargs);
    if (tuple == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    PyObject* kwargs = nullptr;
    if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0) {
      kwargs = PyDict_New();
      for (Py_ssize_t i = 0; kwargs != nullptr && i < PyTuple_GET_SIZE(kwnames); ++i) {
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
          Py_CLEAR(kwargs);
      }
      if (kwargs == nullptr) {
        Py_DECREF(tuple);
        return nullptr;
      }
    }
    PyObject* out = PyType_Type.tp_call(type_obj, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return out;
  }
  const Py_ssize_t nbytes = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);   // as "n"
  if (nbytes == -1 && PyErr_Occurred()) return nullptr;
  const int resident = PyObject_IsTrue(args[4]);
  if (resident < 0) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(type_obj);
  PyObject* self = record_new(type, nullptr, nullptr);
  if (self == nullptr) return nullptr;
  if (record_setup(reinterpret_cast<Record*>(self), args[0], args[1], args[2], nbytes,
                   resident != 0, args[5], args[6], args[7]) < 0) {
    Py_DECREF(self);
    return nullptr;
  }
  return self;
}

// records.py NOTE [Record lifetime]: the record gives its payload back and counts itself
// out of its meter when the last save of its storage dies, on whatever thread autograd
// drops it.
void record_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<Record*>(self_obj);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(self_obj);
  leave_index(self);
  self->index.~weak_ptr();
  if (self->counts != nullptr) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);   // dealloc may run while an error is set
    const bool holds_space = self->payload != Py_None;
    if (holds_space) give_back(self);
    // Out of the count after the payload went back: a step that sees no live record left
    // closes its tiers (runtime/step.py NOTE [End of step]).
    self->counts->record_freed(self->nbytes, self->resident, holds_space);
    PyErr_Restore(type, value, traceback);
  }
  Py_CLEAR(self->storage_ref);
  Py_CLEAR(self->tier);
  Py_CLEAR(self->payload);
  Py_CLEAR(self->meta);
  Py_CLEAR(self->meter);
  Py_CLEAR(self->prefetcher);
  Py_CLEAR(self->unpack.cache);
  Py_CLEAR(self->unpack.shared);
  Py_CLEAR(self->unpack.handed);
  Py_CLEAR(self->timeline);
  Py_TYPE(self_obj)->tp_free(self_obj);
}

// `record()`: the storage while it lives, else None (as for a weakref.ref).
PyObject* record_call(PyObject* self_obj, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "Record() takes no arguments");
    return nullptr;
  }
  auto* self = reinterpret_cast<Record*>(self_obj);
  if (self->storage_ref == nullptr) Py_RETURN_NONE;
  if (self->holds_storage) return Py_NewRef(self->storage_ref);
  return Py_NewRef(PyWeakref_GetObject(self->storage_ref));
}

// note_packed(timeline, position): a row on the core's `timeline` for this storage, packed
// now (the `position`-th storage the step stored); the unpacker notes its first unpack there.
PyObject* record_note_packed(PyObject* self_obj, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "Record.note_packed takes 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  if (!is_timeline(args[0])) {
    PyErr_Format(PyExc_TypeError, "offload: the core's Record is timed on the core's "
                 "Timeline, not %s", Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  auto* self = reinterpret_cast<Record*>(self_obj);
  if (self->counts == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: a Record is timed once initialised");
    return nullptr;
  }
  const long long position = PyLong_AsLongLong(args[1]);
  if (position == -1 && PyErr_Occurred()) return nullptr;
  if (!record_timed(self_obj, args[0], position)) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef record_methods[] = {
    {"note_packed",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_note_packed)),
     METH_FASTCALL,
     "note_packed(timeline, position): a row on `timeline` for this storage, packed now "
     "(time.perf_counter()'s clock)."},
    {nullptr, nullptr, 0, nullptr},
};

// The unpack cache's objects, set from records.py: never deleted (record_load.cpp reads them
// without a NULL check), `handed` None or a dict.
template <PyObject* UnpackCache::*field>
PyObject* get_cache_field(PyObject* self, void*) {
  PyObject* value = reinterpret_cast<Record*>(self)->unpack.*field;
  return Py_NewRef(value != nullptr ? value : Py_None);   // (before __init__ ran: NULL)
}

template <PyObject* UnpackCache::*field>
int set_cache_field(PyObject* self, PyObject* value, void* name) {
  if (value == nullptr) {
    PyErr_Format(PyExc_AttributeError, "Record.%s cannot be deleted (set it to None)",
                 static_cast<const char*>(name));
    return -1;
  }
  if (field == &UnpackCache::handed && value != Py_None && !PyDict_CheckExact(value)) {
    PyErr_Format(PyExc_TypeError, "Record.handed must be None or a dict, got %s",
                 Py_TYPE(value)->tp_name);
    return -1;
  }
  Py_XSETREF(reinterpret_cast<Record*>(self)->unpack.*field, Py_NewRef(value));
  return 0;
}

#define CACHE_OBJECT(name)                                                            \
  {const_cast<char*>(#name), get_cache_field<&UnpackCache::name>,                    \
   set_cache_field<&UnpackCache::name>, nullptr, const_cast<char*>(#name)}

PyGetSetDef record_getset[] = {
    CACHE_OBJECT(cache),
    CACHE_OBJECT(shared),
    CACHE_OBJECT(handed),
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

#undef CACHE_OBJECT

#define RECORD_MEMBER(name, type, flags) \
  {const_cast<char*>(#name), type, offsetof(Record, name), flags, nullptr}
#define CACHE_MEMBER(name, type) \
  {const_cast<char*>(#name), type, offsetof(Record, unpack.name), 0, nullptr}

PyMemberDef record_members[] = {
    RECORD_MEMBER(tier, T_OBJECT, READONLY),
    RECORD_MEMBER(payload, T_OBJECT, READONLY),
    RECORD_MEMBER(nbytes, T_PYSSIZET, READONLY),
    RECORD_MEMBER(resident, T_BOOL, READONLY),
    RECORD_MEMBER(meta, T_OBJECT, READONLY),
    RECORD_MEMBER(meter, T_OBJECT, READONLY),
    RECORD_MEMBER(prefetcher, T_OBJECT, READONLY),
    CACHE_MEMBER(handles_left, T_PYSSIZET),
    CACHE_MEMBER(cache_offset, T_PYSSIZET),
    RECORD_MEMBER(timeline, T_OBJECT, READONLY),   // set by note_packed: a core Timeline
    RECORD_MEMBER(row, T_PYSSIZET, READONLY),
    RECORD_MEMBER(version, T_PYSSIZET, 0),
    {nullptr, 0, 0, 0, nullptr},
};

#undef RECORD_MEMBER
#undef CACHE_MEMBER

PyTypeObject record_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.Record", sizeof(Record),
      "Record(storage, tier, payload, nbytes, resident, meta, meter, prefetcher): one "
      "stored storage of a step (offload/runtime/records.py).",
      record_new, record_dealloc);
  type.tp_init = record_init;
  type.tp_vectorcall = record_vectorcall;
  type.tp_call = record_call;
  type.tp_members = record_members;
  type.tp_getset = record_getset;
  type.tp_methods = record_methods;
  type.tp_weaklistoffset = offsetof(Record, weakrefs);
  return type;
}();

}  // namespace

bool record_holds_space(PyObject* record_obj) {
  if (Py_TYPE(record_obj) != &record_type) return false;
  return reinterpret_cast<Record*>(record_obj)->payload != Py_None;
}

bool is_record(PyObject* obj) { return Py_TYPE(obj) == &record_type; }
bool is_record_type(PyObject* obj) { return obj == reinterpret_cast<PyObject*>(&record_type); }

PyObject* record_tier(PyObject* record) { return reinterpret_cast<Record*>(record)->tier; }
PyObject* record_payload(PyObject* record) { return reinterpret_cast<Record*>(record)->payload; }
PyObject* record_meta(PyObject* record) { return reinterpret_cast<Record*>(record)->meta; }
PyObject* record_prefetcher(PyObject* record) {
  return reinterpret_cast<Record*>(record)->prefetcher;
}
UnpackCache* record_cache(PyObject* record) { return &reinterpret_cast<Record*>(record)->unpack; }
bool record_resident(PyObject* record) { return reinterpret_cast<Record*>(record)->resident; }

void record_handle_added(PyObject* record) {
  ++reinterpret_cast<Record*>(record)->unpack.handles_left;
}

void record_handle_done(PyObject* record_obj) {
  UnpackCache* cache = &reinterpret_cast<Record*>(record_obj)->unpack;
  if (--cache->handles_left <= 0) {
    Py_XSETREF(cache->cache, Py_NewRef(Py_None));
    Py_CLEAR(cache->handed);
  }
}

bool record_stored_as(PyObject* record_obj, PyObject* storage, long long version) {
  const auto* record = reinterpret_cast<Record*>(record_obj);
  return record->version == version && names_storage(record, storage);
}

void record_indexed(PyObject* record_obj, long long version,
                    const std::shared_ptr<IndexEntries>* entries, PyObject* storage) {
  auto* record = reinterpret_cast<Record*>(record_obj);
  record->version = version;
  if (entries == nullptr) return;
  leave_index(record);   // in one entry at most (a storage is stored once per version)
  (*entries)->map[storage] = record_obj;
  record->index = *entries;
  record->index_key = storage;
}

bool record_timed(PyObject* record_obj, PyObject* timeline, long long position) {
  if (!is_timeline(timeline)) {
    PyErr_Format(PyExc_TypeError, "offload: the core's Record is timed on the core's "
                 "Timeline, not %s", Py_TYPE(timeline)->tp_name);
    return false;
  }
  auto* record = reinterpret_cast<Record*>(record_obj);
  const Py_ssize_t row = timeline_add_row(timeline, position, record->nbytes, perf_counter_s());
  if (row < 0) return false;
  Py_XSETREF(record->timeline, Py_NewRef(timeline));
  record->row = row;
  return true;
}

bool record_unpacked(PyObject* record_obj) {
  auto* record = reinterpret_cast<Record*>(record_obj);
  if (record->timeline == nullptr || record->timeline == Py_None) return true;
  return timeline_unpacked(record->timeline, record->row, perf_counter_s());
}

Py_ssize_t record_nbytes(PyObject* record) { return reinterpret_cast<Record*>(record)->nbytes; }

void bind_saved_record(py::module_& m) {
  release_name = PyUnicode_InternFromString("release");
  if (release_name == nullptr) throw py::error_already_set();
  add_type(m, "Record", record_type);
}

}  // namespace offload::bind

// saved_handles.py's `Moved` in C: what autograd holds for a saved tensor whose storage went to a
// tier (moved_save.hpp). Made by the packer's move path (pack_moved.cpp), unpacked by the
// Unpacker (hook_unpacker.cpp) or, while a profiler runs, through its `unpack(lock)` method.
//
// Not tracked by the garbage collector, for the reason the other handles are not
// (saved_handles.cpp): autograd alone holds one, so a cycle through it runs through an
// autograd node the collector cannot see anyway. It holds no tensor of the forward: its
// sentinel is a detached alias whose data was swapped for an empty tensor (version_check.py
// NOTE [Version check]), and an input is named through a weak reference. What it may hold
// of the user's is the tensor's attribute dict (tensor_meta.py NOTE [Saved attributes]).
//
// Torch-independent like the rest of the front: the tensor is read through Python calls
// (`detach`, `.data =`), and its layout rebuilt by view_layout.cpp, whose torch functions
// `configure_moved` sets with this file's own (saved_handles.py).
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include <vector>

#include "bindings.hpp"
#include "moved_save.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "record_load.hpp"
#include "saved_record.hpp"
#include "view_layout.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct MovedSave {
  PyObject_HEAD
  PyObject* record;        // the core's Record of the storage
  ViewLayout layout;       // the view layout over the stored bytes (tensor_meta.ViewMeta)
  char is_output;             // saved by its own node (autograd names that node)
  char is_view;
  char unpacked;              // its unpack ran (or its record was told it died)
  long long version;          // the tensor's version at pack
  PyObject* sentinel;         // zero bytes, shares the tensor's version counter
  PyObject* origin;           // an input: a weak reference to it (named at unpack); else None
  PyObject* node_name;        // type(grad_fn).__name__ at pack, None for a leaf
  long long output_nr;
  PyObject* attrs;            // the tensor's attribute dict, shared; nullptr: it had none
};

// What unpack calls, set once from saved_handles.py (`configure_moved`).
struct MovedCalls {
  PyObject* load = nullptr;           // records.load
  PyObject* version_error = nullptr;  // saved_handles.moved_version_error
  PyObject* next_sequence_nr = nullptr;  // version_check.next_sequence_nr (None: unknown)
  PyObject* rebuild_as_resized = nullptr;  // tensor_meta.rebuild_as_resized
} calls;

PyObject* n_data;
PyObject* n_dict;

void moved_save_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<MovedSave*>(obj);
  if (!self->unpacked && self->record != nullptr) record_handle_done(self->record);
  Py_CLEAR(self->record);   // may free the record: it gives its payload back
  clear_layout(&self->layout);
  Py_CLEAR(self->sentinel);
  Py_CLEAR(self->origin);
  Py_CLEAR(self->node_name);
  Py_CLEAR(self->attrs);
  Py_TYPE(obj)->tp_free(obj);
}

// Raises autograd's error for `self` at version `seen` (saved_handles.moved_version_error).
[[noreturn]] void raise_version_error(MovedSave* self, long long seen) {
  if (calls.version_error == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: saved_handles.py did not configure_moved");
    throw py::error_already_set();
  }
  py::object at = py::reinterpret_steal<py::object>(PyLong_FromLongLong(seen));
  if (!at) throw py::error_already_set();
  py::object exc = call_with(calls.version_error, py::handle(reinterpret_cast<PyObject*>(self)),
                             at);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// Raises autograd's error when the tensor changed in place since pack (NOTE [Version check]).
void check_version(MovedSave* self) {
  const long long seen = as_int(attr(self->sentinel, names.version));
  if (seen != self->version) raise_version_error(self, seen);
}

// records.load; the caller holds the hooks' lock (the record's cache and the tier's queues
// are shared with autograd's other threads). A CPU nvme payload's bytes come as the saved
// dtype when its storage holds a whole number of them (view_layout.cpp rebuild_over_flat).
// A copy that earlier saves of the storage were handed and wrote into since it was loaded
// raises autograd's error, for the writes autograd would have counted on the saved tensor
// (records.py NOTE [Writes into a shared copy]).
py::object load_bytes(MovedSave* self, Py_ssize_t* offset, bool* flat) {
  PyObject* dtype = record_nbytes(self->record) % self->layout.itemsize == 0
      ? self->layout.dtype : nullptr;
  long long written = 0;
  PyObject* storage = record_load(self->record, calls.load, offset, flat, dtype, &written);
  if (storage == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(storage);
  if (written != 0) raise_version_error(self, self->version + written);
  return out;
}

PyObject* moved_save_unpack(PyObject* obj, PyObject* lock) {
  return guarded([&] { return unpack_moved(obj, lock); });
}

#define MOVED_MEMBER(name, type) \
  {const_cast<char*>(#name), type, offsetof(MovedSave, name), READONLY, nullptr}
#define LAYOUT_MEMBER(name, type) \
  {const_cast<char*>(#name), type, offsetof(MovedSave, layout.name), READONLY, nullptr}

PyMemberDef moved_members[] = {
    MOVED_MEMBER(record, T_OBJECT),       LAYOUT_MEMBER(dtype, T_OBJECT),
    LAYOUT_MEMBER(storage_offset, T_LONGLONG), LAYOUT_MEMBER(conj, T_BOOL),
    LAYOUT_MEMBER(neg, T_BOOL),           MOVED_MEMBER(is_output, T_BOOL),
    MOVED_MEMBER(is_view, T_BOOL),        MOVED_MEMBER(unpacked, T_BOOL),
    MOVED_MEMBER(version, T_LONGLONG),    MOVED_MEMBER(sentinel, T_OBJECT),
    MOVED_MEMBER(origin, T_OBJECT),       MOVED_MEMBER(node_name, T_OBJECT),
    MOVED_MEMBER(output_nr, T_LONGLONG),   MOVED_MEMBER(attrs, T_OBJECT),
    {nullptr, 0, 0, 0, nullptr},
};

#undef MOVED_MEMBER
#undef LAYOUT_MEMBER

PyObject* moved_size(PyObject* obj, void*) {
  return guarded([&] {
    return layout_dims(&reinterpret_cast<MovedSave*>(obj)->layout, 0).release().ptr();
  });
}

PyObject* moved_stride(PyObject* obj, void*) {
  return guarded([&] {
    const ViewLayout* layout = &reinterpret_cast<MovedSave*>(obj)->layout;
    return layout_dims(layout, layout->ndim).release().ptr();
  });
}

PyGetSetDef moved_getset[] = {
    {const_cast<char*>("size"), moved_size, nullptr,
     const_cast<char*>("The saved tensor's size."), nullptr},
    {const_cast<char*>("stride"), moved_stride, nullptr,
     const_cast<char*>("The saved tensor's stride."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef moved_methods[] = {
    {"unpack", moved_save_unpack, METH_O,
     "unpack(lock): the saved tensor back, its version checked, its bytes loaded under "
     "`lock` (saved_handles.Moved.unpack)."},
    {nullptr, nullptr, 0, nullptr},
};

// configure_moved(load, empty, empty_strided, neg_view, version_error, next_sequence_nr,
// rebuild_as_resized): what a MovedSave calls.
PyObject* configure_moved(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"load", "empty", "empty_strided", "neg_view",
                                   "version_error", "next_sequence_nr", "rebuild_as_resized",
                                   nullptr};
  PyObject *load, *empty, *empty_strided, *neg_view, *version_error, *next_sequence_nr,
      *rebuild_as_resized;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO", const_cast<char**>(keywords), &load,
                                   &empty, &empty_strided, &neg_view, &version_error,
                                   &next_sequence_nr, &rebuild_as_resized))
    return nullptr;
  Py_XSETREF(calls.rebuild_as_resized, Py_NewRef(rebuild_as_resized));
  Py_XSETREF(calls.next_sequence_nr, Py_NewRef(next_sequence_nr));
  Py_XSETREF(calls.load, Py_NewRef(load));
  configure_layout(empty, empty_strided, neg_view);
  Py_XSETREF(calls.version_error, Py_NewRef(version_error));
  Py_RETURN_NONE;
}

// moved_save(t, record, version, node, base, empty): the MovedSave of `t` (hooks.py's
// Python path makes the core's handle too, so a core record is only ever loaded here).
PyObject* moved_save(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError, "moved_save takes 6 arguments (%zd given)", nargs);
    return nullptr;
  }
  const long long version = PyLong_AsLongLong(args[2]);
  if (version == -1 && PyErr_Occurred()) return nullptr;
  if (calls.next_sequence_nr == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: saved_handles.py did not configure_moved");
    return nullptr;
  }
  return new_moved_save(args[0], args[1], args[3], args[4], version, calls.next_sequence_nr,
                        args[5]);
}

PyMethodDef module_functions[] = {
    {"configure_moved", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure_moved)),
     METH_VARARGS | METH_KEYWORDS,
     "configure_moved(load, empty, empty_strided, neg_view, version_error, next_sequence_nr, "
     "rebuild_as_resized): what a "
     "MovedSave calls (saved_handles.py sets it at import)."},
    {"moved_save", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(moved_save)),
     METH_FASTCALL,
     "moved_save(t, record, version, node, base, empty): the MovedSave of `t`, whose storage "
     "is the core's `record` (`empty`: a zero-byte tensor on t's device)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyTypeObject moved_save_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.MovedSave", sizeof(MovedSave),
      "What autograd holds for a saved tensor whose storage went to a tier (saved_handles.Moved).",
      nullptr, moved_save_dealloc);
  type.tp_members = moved_members;
  type.tp_getset = moved_getset;
  type.tp_methods = moved_methods;
  return type;
}();

PyObject* new_moved_save(PyObject* t, PyObject* record, PyObject* node, PyObject* base,
                         long long version, PyObject* next_sequence_nr, PyObject* empty,
                         long long storage_offset) {
  return guarded([&]() -> PyObject* {
    if (!is_record(record)) {
      PyErr_SetString(PyExc_TypeError, "offload: a MovedSave holds the core's Record");
      throw py::error_already_set();
    }
    // The sentinel first: it reads `t`, which nothing below changes.
    py::object sentinel = call_method(t, names.detach);
    if (PyObject_SetAttr(sentinel.ptr(), n_data, empty) < 0) throw py::error_already_set();
    // Not tracked by the collector: a detached alias with no grad_fn, hooks or attributes
    // refers to no Python object (its data is the shared empty tensor, which we hold
    // anyway), so it can be in no cycle; tracked, it is one more object per save for
    // every collection to walk until the backward (docs/benchmarks.md *Hook cost*).
    if (PyObject_GC_IsTracked(sentinel.ptr())) PyObject_GC_UnTrack(sentinel.ptr());
    auto save = py::reinterpret_steal<py::object>(moved_save_type.tp_alloc(&moved_save_type, 0));
    if (!save) throw py::error_already_set();
    auto* self = reinterpret_cast<MovedSave*>(save.ptr());
    self->unpacked = 1;   // counted as a handle of its record only once it is complete
    self->record = Py_NewRef(record);
    self->sentinel = sentinel.release().ptr();
    self->version = version;
    self->attrs = Py_XNewRef(instance_attrs(t));   // tensor_meta.py NOTE [Saved attributes]
    read_layout(&self->layout, t, record_meta(record), storage_offset);
    // What autograd's message names (version_check.py SavedOrigin): the saving node for an
    // output (made last, so its sequence number is the one before the thread's next), an
    // input's grad_fn at unpack, through a weak reference to it.
    self->is_output = saving_node(node, next_sequence_nr);
    self->is_view = base != Py_None;
    self->output_nr = as_int(attr(t, names.output_nr));
    self->node_name = node != Py_None
        ? attr(reinterpret_cast<PyObject*>(Py_TYPE(node)), names.name).release().ptr()
        : Py_NewRef(Py_None);
    if (self->is_output || node == Py_None) {
      self->origin = Py_NewRef(Py_None);
    } else {
      self->origin = untracked_weakref(t);
      if (self->origin == nullptr) throw py::error_already_set();
    }
    record_handle_added(record);
    self->unpacked = 0;
    return save.release().ptr();
  });
}

// The storage itself, when it still lives with another size than it was stored at
// (saved_handles.py NOTE [A storage resized since its pack]); None otherwise.
py::object resized_storage(MovedSave* self) {
  // A snapshot's record (it has a layout of its own: tensor_meta NOTE [Untracked aliases])
  // stored a private copy of part of the storage, taken at the pack: not this case.
  if (record_meta(self->record) != Py_None) return py::none();
  py::object live = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(self->record));
  if (!live) throw py::error_already_set();
  if (live.ptr() == Py_None ||
      as_int(call_method(live.ptr(), names.nbytes)) == record_nbytes(self->record)) {
    return py::none();
  }
  return live;
}

// What the unpack cache tells saves apart by (records.py NOTE [One tensor per layout]): the
// layout's numbers, its dtype and the attribute dict, as bytes.
py::object layout_key(const MovedSave* self) {
  const ViewLayout& l = self->layout;
  std::vector<long long> k = {reinterpret_cast<long long>(l.dtype),
                              reinterpret_cast<long long>(self->attrs), l.storage_offset,
                              l.conj, l.neg, static_cast<long long>(l.ndim)};
  k.insert(k.end(), l.dims, l.dims + 2 * l.ndim);
  return py::bytes(reinterpret_cast<const char*>(k.data()), k.size() * sizeof(long long));
}

// A copy of the bytes a save is rebuilt over: its storage's (for a flat tensor, the whole
// storage it is a view of: the bytes' offset is in the storage).
py::object storage_copy(const py::object& bytes, bool flat) {
  const py::object storage = flat ? call_method(bytes.ptr(), names.untyped_storage) : bytes;
  return call_method(storage.ptr(), names.clone);
}

// The save's tensor, `build(over, over_flat)` over `bytes` (the loaded flat tensor or
// storage, or the live storage resized since the pack): the one handed out already for its
// layout while other saves of the storage are still to be unpacked, else a new one, over a
// copy of the bytes' storage when another layout was handed them or `own` asks for one
// (records.py NOTE [One tensor per layout]). The caller holds the hooks' lock.
template <typename Build>
py::object handed_out(MovedSave* self, const py::object& bytes, bool flat, bool own,
                      Build build) {
  UnpackCache* cache = record_cache(self->record);
  if (cache->handed == Py_None) Py_CLEAR(cache->handed);   // (as records.py may set it)
  py::object key;
  if (cache->handed != nullptr) {
    key = layout_key(self);
    PyObject* seen = PyDict_GetItemWithError(cache->handed, key.ptr());   // borrowed
    if (seen != nullptr) {
      // A save whose strides were restored (tensor_meta NOTE [Snapshot strides]) was
      // handed a fresh tensor, version 1 after its copy: a write into it since is not in
      // the loaded bytes' counter, so it is counted here (records.py NOTE [Writes into a
      // shared copy]).
      if (self->layout.handed_stride != nullptr) {
        const long long written = as_int(attr(seen, names.version)) - 1;
        if (written > 0) raise_version_error(self, self->version + written);
      }
      return py::reinterpret_borrow<py::object>(seen);
    }
    if (PyErr_Occurred()) throw py::error_already_set();
  }
  const bool apart = cache->handed != nullptr && PyDict_GET_SIZE(cache->handed) > 0;
  const bool copied = apart || own;
  const py::object over = copied ? storage_copy(bytes, flat) : bytes;
  py::object out = build(over, flat && !copied);
  if (self->attrs != nullptr) {   // tensor_meta.py NOTE [Saved attributes]
    // Never on the flat tensor itself: every layout of the storage may be handed it.
    if (out.ptr() == over.ptr()) out = call_method(out.ptr(), names.detach);
    if (PyObject_SetAttr(out.ptr(), n_dict, self->attrs) < 0) throw py::error_already_set();
  }
  if (cache->handles_left > (self->unpacked ? 0 : 1)) {   // others to come get this one
    if (cache->handed == nullptr && (cache->handed = PyDict_New()) == nullptr)
      throw py::error_already_set();
    if (!key) key = layout_key(self);
    if (PyDict_SetItem(cache->handed, key.ptr(), out.ptr()) < 0) throw py::error_already_set();
  }
  return out;
}

PyObject* unpack_moved(PyObject* obj, PyObject* lock) {
  return guarded([&] {
    auto* self = reinterpret_cast<MovedSave*>(obj);
    check_version(self);
    py::object resized = resized_storage(self);
    py::object out;
    {
      // Under the hooks' lock, as the load: autograd may unpack saves of one storage on two
      // threads, and each must find what the other handed out.
      PyLockHeld locked(lock);
      if (!resized.is_none()) {   // as autograd would: over the storage as it is now ...
        // ... copied: a tensor over the live storage taken as a `.grad` would be the user's
        // tensor's memory (autograd copies its own saved tensor, which the user holds).
        out = handed_out(self, resized, false, true, [&](const py::object& over, bool) {
          return call_with(calls.rebuild_as_resized, over, py::handle(obj));
        });
      } else {
        Py_ssize_t offset = 0;
        bool flat = false;
        py::object bytes = load_bytes(self, &offset, &flat);
        out = handed_out(self, bytes, flat, false, [&](const py::object& over, bool over_flat) {
          return over_flat
              ? rebuild_over_flat(&self->layout, over, offset, record_nbytes(self->record))
              : rebuild_over_storage(&self->layout, over, offset);
        });
      }
    }
    if (!self->unpacked) {
      self->unpacked = 1;
      record_handle_done(self->record);
    }
    return out.release().ptr();
  });
}

void bind_moved_save(py::module_& m) {
  n_data = intern("data");
  n_dict = intern("__dict__");
  init_layout_names();
  add_type(m, "MovedSave", moved_save_type);
  for (PyMethodDef* def = module_functions; def->ml_name != nullptr; ++def) {
    PyObject* fn = PyCFunction_New(def, nullptr);
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace offload::bind

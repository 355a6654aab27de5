// records.py's `Moved` in C: what autograd holds for a saved tensor whose storage went to a
// tier (moved_save.hpp). Made by the packer's move path (pack_moved.cpp), unpacked by the
// Unpacker (hook_unpacker.cpp) or, while a profiler runs, through its `unpack(lock)` method.
//
// Not tracked by the garbage collector, for the reason the other handles are not
// (saved_handles.cpp): autograd alone holds one, so a cycle through it runs through an
// autograd node the collector cannot see anyway. It holds no tensor of the forward: its
// sentinel is a detached alias whose data was swapped for an empty tensor (version_check.py
// NOTE [Version check]), and an input is named through a weak reference.
//
// Torch-independent like the rest of the front: the tensor is read and rebuilt through
// Python calls (`detach`, `.data =`, `torch.empty`, `set_`), set once by
// `configure_moved` (records.py).
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "moved_save.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "saved_record.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct MovedSave {
  PyObject_HEAD
  PyObject* record;        // the core's Record of the storage
  // The view layout over the stored bytes (tensor_meta.ViewMeta's fields).
  PyObject* dtype;
  // size then stride, `ndim` of each (PyMem_Malloc'd; null for a 0-d tensor): C numbers,
  // not tuples, which would be two more objects per save the collector counts.
  long long* dims;
  Py_ssize_t ndim;
  long long storage_offset;   // in elements
  long long itemsize;         // dtype's, in bytes
  char conj;
  char neg;
  char is_output;             // saved by its own node (autograd names that node)
  char is_view;
  char unpacked;              // its unpack ran (or its record was told it died)
  long long version;          // the tensor's version at pack
  PyObject* sentinel;         // zero bytes, shares the tensor's version counter
  PyObject* origin;           // an input: a weak reference to it (named at unpack); else None
  PyObject* node_name;        // type(grad_fn).__name__ at pack, None for a leaf
  long long output_nr;
};

// What unpack calls, set once from records.py (`configure_moved`).
struct MovedCalls {
  PyObject* load = nullptr;           // records.load
  PyObject* empty = nullptr;          // torch.empty
  PyObject* neg_view = nullptr;       // torch._neg_view
  PyObject* version_error = nullptr;  // records.moved_version_error
  PyObject* next_sequence_nr = nullptr;  // version_check.next_sequence_nr (None: unknown)
} calls;

PyObject* n_dtype;
PyObject* n_device;
PyObject* n_data;
PyObject* n_itemsize;
PyObject* n_shape;
PyObject* n_stride;
PyObject* n_is_conj;
PyObject* n_is_neg;
PyObject* n_conj;
PyObject* n_set;
PyObject* n_view;
PyObject* n_is_complex;
PyObject* n_as_strided;
PyObject* kw_dtype_device;   // ("dtype", "device")

void moved_save_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<MovedSave*>(obj);
  if (!self->unpacked && self->record != nullptr) record_handle_done(self->record);
  Py_CLEAR(self->record);   // may free the record: it gives its payload back
  Py_CLEAR(self->dtype);
  PyMem_Free(self->dims);
  self->dims = nullptr;
  Py_CLEAR(self->sentinel);
  Py_CLEAR(self->origin);
  Py_CLEAR(self->node_name);
  Py_TYPE(obj)->tp_free(obj);
}

// What a save reads of its dtype: remembered per dtype (torch's dtypes live for the
// process, and a handful is in use), each read costs a Python attribute lookup.
struct DtypeFacts {
  PyObject* dtype;
  long long itemsize;
  bool complex;
};

DtypeFacts facts_of(PyObject* dtype) {
  static DtypeFacts seen[32];
  static int known = 0;
  for (int i = 0; i < known; ++i)
    if (seen[i].dtype == dtype) return seen[i];
  const DtypeFacts facts{dtype, as_int(attr(dtype, n_itemsize)),
                         attr(dtype, n_is_complex).ptr() == Py_True};
  if (known < 32) {
    seen[known] = facts;
    seen[known++].dtype = Py_NewRef(dtype);
  }
  return facts;
}

// Raises autograd's error when the tensor changed in place since pack (NOTE [Version check]).
void check_version(MovedSave* self) {
  const long long seen = as_int(attr(self->sentinel, names.version));
  if (seen == self->version) return;
  if (calls.version_error == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: records.py did not configure_moved");
    throw py::error_already_set();
  }
  py::object exc = call_with(calls.version_error, py::handle(reinterpret_cast<PyObject*>(self)));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// records.load under the hooks' `lock` (the record's cache and the tier's queues are
// shared with autograd's other threads); a CPU nvme payload's bytes come as the saved dtype
// when its storage holds a whole number of them (see rebuild_flat).
py::object load_locked(MovedSave* self, PyObject* lock, Py_ssize_t* offset, bool* flat) {
  PyObject* storage;
  PyObject* dtype = record_nbytes(self->record) % self->itemsize == 0 ? self->dtype : nullptr;
  {
    PyLockHeld locked(lock);
    storage = record_load(self->record, calls.load, offset, flat, dtype);
  }
  if (storage == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(storage);
}

// The saved size (`from` 0) or stride (`from` ndim) as a tuple.
py::object dims_tuple(const MovedSave* self, Py_ssize_t from) {
  py::object out = py::reinterpret_steal<py::object>(PyTuple_New(self->ndim));
  if (!out) throw py::error_already_set();
  for (Py_ssize_t i = 0; i < self->ndim; ++i) {
    PyObject* value = PyLong_FromLongLong(self->dims[from + i]);
    if (value == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, value);
  }
  return out;
}

// Fills `self->dims` from a size and a stride (tuples, torch.Size among them).
void set_dims(MovedSave* self, PyObject* size, PyObject* stride) {
  if (!PyTuple_Check(size) || !PyTuple_Check(stride) ||
      PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride)) {
    PyErr_SetString(PyExc_TypeError, "offload: a saved tensor's size and stride must be "
                    "tuples of one length");
    throw py::error_already_set();
  }
  const Py_ssize_t ndim = PyTuple_GET_SIZE(size);
  if (ndim > 0) {
    self->dims = static_cast<long long*>(PyMem_Malloc(2 * ndim * sizeof(long long)));
    if (self->dims == nullptr) {
      PyErr_NoMemory();
      throw py::error_already_set();
    }
  }
  self->ndim = ndim;
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    self->dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
    self->dims[ndim + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
  }
  if (PyErr_Occurred()) throw py::error_already_set();
}

// tensor_meta.rebuild: the saved layout over `storage`, whose bytes start at `byte_offset`.
py::object rebuild(MovedSave* self, const py::object& storage, Py_ssize_t byte_offset) {
  if (byte_offset % self->itemsize != 0) {
    PyErr_Format(PyExc_ValueError, "offload: byte offset %zd is not a multiple of the "
                 "saved tensor's element size %lld", byte_offset, self->itemsize);
    throw py::error_already_set();
  }
  py::object device = attr(storage.ptr(), n_device);
  py::object zero = py::reinterpret_steal<py::object>(PyLong_FromLong(0));
  py::object offset = py::reinterpret_steal<py::object>(
      PyLong_FromLongLong(byte_offset / self->itemsize + self->storage_offset));
  if (!zero || !offset) throw py::error_already_set();
  PyObject* empty_args[] = {zero.ptr(), self->dtype, device.ptr()};
  PyObject* made = PyObject_Vectorcall(calls.empty, empty_args, 1, kw_dtype_device);
  if (made == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(made);
  py::object size = dims_tuple(self, 0);
  py::object stride = dims_tuple(self, self->ndim);
  PyObject* set_args[] = {out.ptr(), storage.ptr(), offset.ptr(), size.ptr(), stride.ptr()};
  PyObject* set = PyObject_VectorcallMethod(n_set, set_args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            nullptr);
  if (set == nullptr) throw py::error_already_set();
  Py_DECREF(set);   // set_ returns `out` itself
  return out;
}

// `out` with the saved conjugate / negative bits: lazy flags on top of the same bytes.
py::object with_bits(const MovedSave* self, py::object out) {
  if (self->conj) out = call_method(out.ptr(), n_conj);
  if (self->neg) out = call_with(calls.neg_view, out);
  return out;
}

// Whether the saved layout is its whole storage, contiguous from its start (the common
// saved activation: `view(size)` of the stored bytes rebuilds it).
bool spans_storage(const MovedSave* self) {
  if (self->storage_offset != 0) return false;
  long long expected = 1;
  for (Py_ssize_t i = self->ndim - 1; i >= 0; --i) {
    const long long size = self->dims[i];
    // Every stride as view(size) makes it, a size-1 dimension's too: a backward may read
    // those (a memory format is told by them), and the rebuilt tensor must be the saved one.
    if (self->dims[self->ndim + i] != expected) return false;
    expected *= size;
  }
  return expected * self->itemsize == record_nbytes(self->record);
}

// `flat.view(*size)`: the size as separate arguments, which torch parses in about half the
// time of a tuple (docs/benchmarks.md *Hook cost*).
py::object view_as_size(const MovedSave* self, const py::object& flat) {
  constexpr Py_ssize_t kMaxArgs = 16;
  if (self->ndim == 0 || self->ndim > kMaxArgs)   // view(()) takes the tuple
    return call_with(attr(flat.ptr(), n_view).ptr(), dims_tuple(self, 0));
  PyObject* args[kMaxArgs + 1] = {flat.ptr()};
  Py_ssize_t made = 0;
  PyObject* out = nullptr;
  for (; made < self->ndim; ++made) {
    args[made + 1] = PyLong_FromLongLong(self->dims[made]);
    if (args[made + 1] == nullptr) break;
  }
  if (made == self->ndim)
    out = PyObject_VectorcallMethod(n_view, args, (1 + made) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                    nullptr);
  for (Py_ssize_t i = 1; i <= made; ++i) Py_DECREF(args[i]);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// The saved layout over `bytes`, the flat tensor a CPU nvme payload was handed out as (its
// bytes start at `byte_offset` of its storage): as the saved dtype (handed out so, or a
// view of it as that dtype), then the saved size, stride and offset over that. The whole
// storage as one contiguous dimension is that tensor itself: plain autograd too gives
// every save of one tensor the same tensor back. A storage whose size or offset is not a
// multiple of the dtype's size (bytes reinterpreted by a view of another dtype) is rebuilt
// over its storage.
py::object rebuild_flat(MovedSave* self, const py::object& bytes, Py_ssize_t byte_offset) {
  if (byte_offset % self->itemsize != 0 || record_nbytes(self->record) % self->itemsize != 0)
    return rebuild(self, call_method(bytes.ptr(), names.untyped_storage), byte_offset);
  py::object typed = attr(bytes.ptr(), n_dtype).ptr() == self->dtype
      ? bytes : call_with(attr(bytes.ptr(), n_view).ptr(), py::handle(self->dtype));
  if (spans_storage(self))   // the whole storage, contiguous: a view of it (no strides)
    return self->ndim == 1 ? typed : view_as_size(self, typed);
  py::object size = dims_tuple(self, 0);
  py::object stride = dims_tuple(self, self->ndim);
  py::object offset = py::reinterpret_steal<py::object>(
      PyLong_FromLongLong(byte_offset / self->itemsize + self->storage_offset));
  if (!offset) throw py::error_already_set();
  PyObject* args[] = {typed.ptr(), size.ptr(), stride.ptr(), offset.ptr()};
  PyObject* made = PyObject_VectorcallMethod(n_as_strided, args,
                                             4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (made == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(made);
}

PyObject* moved_save_unpack(PyObject* obj, PyObject* lock) {
  return guarded([&] { return unpack_moved(obj, lock); });
}

#define MOVED_MEMBER(name, type) \
  {const_cast<char*>(#name), type, offsetof(MovedSave, name), READONLY, nullptr}

PyMemberDef moved_members[] = {
    MOVED_MEMBER(record, T_OBJECT),       MOVED_MEMBER(dtype, T_OBJECT),
    MOVED_MEMBER(storage_offset, T_LONGLONG), MOVED_MEMBER(conj, T_BOOL),
    MOVED_MEMBER(neg, T_BOOL),            MOVED_MEMBER(is_output, T_BOOL),
    MOVED_MEMBER(is_view, T_BOOL),        MOVED_MEMBER(unpacked, T_BOOL),
    MOVED_MEMBER(version, T_LONGLONG),    MOVED_MEMBER(sentinel, T_OBJECT),
    MOVED_MEMBER(origin, T_OBJECT),       MOVED_MEMBER(node_name, T_OBJECT),
    MOVED_MEMBER(output_nr, T_LONGLONG),
    {nullptr, 0, 0, 0, nullptr},
};

#undef MOVED_MEMBER

PyObject* moved_size(PyObject* obj, void*) {
  return guarded([&] { return dims_tuple(reinterpret_cast<MovedSave*>(obj), 0).release().ptr(); });
}

PyObject* moved_stride(PyObject* obj, void*) {
  return guarded([&] {
    auto* self = reinterpret_cast<MovedSave*>(obj);
    return dims_tuple(self, self->ndim).release().ptr();
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
     "`lock` (records.Moved.unpack)."},
    {nullptr, nullptr, 0, nullptr},
};

// configure_moved(load, empty, neg_view, version_error, next_sequence_nr): what a MovedSave
// calls.
PyObject* configure_moved(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"load", "empty", "neg_view", "version_error",
                                   "next_sequence_nr", nullptr};
  PyObject *load, *empty, *neg_view, *version_error, *next_sequence_nr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO", const_cast<char**>(keywords), &load,
                                   &empty, &neg_view, &version_error, &next_sequence_nr))
    return nullptr;
  Py_XSETREF(calls.next_sequence_nr, Py_NewRef(next_sequence_nr));
  Py_XSETREF(calls.load, Py_NewRef(load));
  Py_XSETREF(calls.empty, Py_NewRef(empty));
  Py_XSETREF(calls.neg_view, Py_NewRef(neg_view));
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
    PyErr_SetString(PyExc_RuntimeError, "offload: records.py did not configure_moved");
    return nullptr;
  }
  return new_moved_save(args[0], args[1], args[3], args[4], version, calls.next_sequence_nr,
                        args[5]);
}

PyMethodDef module_functions[] = {
    {"configure_moved", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure_moved)),
     METH_VARARGS | METH_KEYWORDS,
     "configure_moved(load, empty, neg_view, version_error, next_sequence_nr): what a "
     "MovedSave calls (records.py sets it at import)."},
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
      "What autograd holds for a saved tensor whose storage went to a tier (records.Moved).",
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
    PyObject* meta = record_meta(record);
    if (meta != Py_None) {   // a snapshot's layout (tensor_meta NOTE [Untracked aliases])
      self->dtype = Py_NewRef(PyTuple_GET_ITEM(meta, 0));
      set_dims(self, PyTuple_GET_ITEM(meta, 1), PyTuple_GET_ITEM(meta, 2));
      self->storage_offset = PyLong_AsLongLong(PyTuple_GET_ITEM(meta, 3));
      self->conj = PyTuple_GET_ITEM(meta, 4) == Py_True;
      self->neg = PyTuple_GET_ITEM(meta, 5) == Py_True;
    } else {
      self->dtype = attr(t, n_dtype).release().ptr();
      set_dims(self, attr(t, n_shape).ptr(), call_method(t, n_stride).ptr());
      self->storage_offset = storage_offset >= 0
          ? storage_offset : as_int(call_method(t, names.storage_offset));
      // Only a complex tensor has a conjugate bit (the check is one lookup per dtype).
      self->conj = facts_of(self->dtype).complex && call_method(t, n_is_conj).ptr() == Py_True;
      self->neg = call_method(t, n_is_neg).ptr() == Py_True;
    }
    if (self->storage_offset == -1 && PyErr_Occurred()) throw py::error_already_set();
    self->itemsize = facts_of(self->dtype).itemsize;
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

PyObject* unpack_moved(PyObject* obj, PyObject* lock) {
  return guarded([&] {
    auto* self = reinterpret_cast<MovedSave*>(obj);
    check_version(self);
    Py_ssize_t offset = 0;
    bool flat = false;
    py::object bytes = load_locked(self, lock, &offset, &flat);
    py::object out = with_bits(
        self, flat ? rebuild_flat(self, bytes, offset) : rebuild(self, bytes, offset));
    if (!self->unpacked) {
      self->unpacked = 1;
      record_handle_done(self->record);
    }
    return out.release().ptr();
  });
}

void bind_moved_save(py::module_& m) {
  n_dtype = intern("dtype");
  n_device = intern("device");
  n_data = intern("data");
  n_itemsize = intern("itemsize");
  n_shape = intern("shape");
  n_stride = intern("stride");
  n_is_conj = intern("is_conj");
  n_is_neg = intern("is_neg");
  n_conj = intern("conj");
  n_set = intern("set_");
  n_view = intern("view");
  n_is_complex = intern("is_complex");
  n_as_strided = intern("as_strided");
  kw_dtype_device = Py_BuildValue("(OO)", n_dtype, n_device);
  if (kw_dtype_device == nullptr) throw py::error_already_set();
  add_type(m, "MovedSave", moved_save_type);
  for (PyMethodDef* def = module_functions; def->ml_name != nullptr; ++def) {
    PyObject* fn = PyCFunction_New(def, nullptr);
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace offload::bind

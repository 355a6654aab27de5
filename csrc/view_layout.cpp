// A saved tensor's view layout over its stored bytes (view_layout.hpp): read at pack from
// the tensor (or its snapshot's layout), rebuilt at unpack over the bytes loaded back.
#include <Python.h>

#include <pybind11/pybind11.h>

#include "py_calls.hpp"
#include "view_layout.hpp"

namespace offload::bind {

namespace {

// What a rebuild calls, set once from saved_handles.py (configure_moved -> configure_layout).
struct LayoutCalls {
  PyObject* empty = nullptr;           // torch.empty
  PyObject* empty_strided = nullptr;   // torch.empty_strided
  PyObject* neg_view = nullptr;        // torch._neg_view
} calls;

PyObject* n_dtype;
PyObject* n_device;
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
PyObject* n_copy;
PyObject* kw_dtype_device;   // ("dtype", "device")

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

// Fills the layout's dims from a size and a stride (tuples, torch.Size among them).
void set_dims(ViewLayout* layout, PyObject* size, PyObject* stride) {
  if (!PyTuple_Check(size) || !PyTuple_Check(stride) ||
      PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride)) {
    PyErr_SetString(PyExc_TypeError, "offload: a saved tensor's size and stride must be "
                    "tuples of one length");
    throw py::error_already_set();
  }
  const Py_ssize_t ndim = PyTuple_GET_SIZE(size);
  if (ndim > 0) {
    layout->dims = static_cast<long long*>(PyMem_Malloc(2 * ndim * sizeof(long long)));
    if (layout->dims == nullptr) {
      PyErr_NoMemory();
      throw py::error_already_set();
    }
  }
  layout->ndim = ndim;
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    layout->dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
    layout->dims[ndim + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
  }
  if (PyErr_Occurred()) throw py::error_already_set();
}

// The layout over `storage` without its bits (rebuild_over_storage).
py::object rebuild(const ViewLayout* layout, const py::object& storage,
                   Py_ssize_t byte_offset) {
  if (byte_offset % layout->itemsize != 0) {
    PyErr_Format(PyExc_ValueError, "offload: byte offset %zd is not a multiple of the "
                 "saved tensor's element size %lld", byte_offset, layout->itemsize);
    throw py::error_already_set();
  }
  py::object device = attr(storage.ptr(), n_device);
  py::object zero = py::reinterpret_steal<py::object>(PyLong_FromLong(0));
  py::object offset = py::reinterpret_steal<py::object>(
      PyLong_FromLongLong(byte_offset / layout->itemsize + layout->storage_offset));
  if (!zero || !offset) throw py::error_already_set();
  if (calls.empty == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "offload: saved_handles.py did not configure_moved");
    throw py::error_already_set();
  }
  PyObject* empty_args[] = {zero.ptr(), layout->dtype, device.ptr()};
  PyObject* made = PyObject_Vectorcall(calls.empty, empty_args, 1, kw_dtype_device);
  if (made == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(made);
  py::object size = layout_dims(layout, 0);
  py::object stride = layout_dims(layout, layout->ndim);
  PyObject* set_args[] = {out.ptr(), storage.ptr(), offset.ptr(), size.ptr(), stride.ptr()};
  PyObject* set = PyObject_VectorcallMethod(n_set, set_args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                            nullptr);
  if (set == nullptr) throw py::error_already_set();
  Py_DECREF(set);   // set_ returns `out` itself
  return out;
}

// `out` in a fresh tensor with a snapshot's saved strides, when it has them (tensor_meta
// NOTE [Snapshot strides]): `empty_strided(size, handed_stride).copy_(out)`, before the bits
// are set (the bytes as they lie).
py::object with_handed_stride(const ViewLayout* layout, py::object out) {
  if (layout->handed_stride == nullptr) return out;
  py::object size = layout_dims(layout, 0);
  py::object device = attr(out.ptr(), n_device);
  PyObject* args[] = {size.ptr(), layout->handed_stride, layout->dtype, device.ptr()};
  PyObject* made = PyObject_Vectorcall(calls.empty_strided, args, 2, kw_dtype_device);
  if (made == nullptr) throw py::error_already_set();
  py::object fresh = py::reinterpret_steal<py::object>(made);
  return call_with(attr(fresh.ptr(), n_copy).ptr(), out);
}

// `out` with the saved conjugate / negative bits: lazy flags on top of the same bytes.
py::object with_bits(const ViewLayout* layout, py::object out) {
  if (layout->conj) out = call_method(out.ptr(), n_conj);
  if (layout->neg) out = call_with(calls.neg_view, out);
  return out;
}

// Whether the layout is its whole storage (of `storage_nbytes`), contiguous from its
// start (the common saved activation: `view(size)` of the stored bytes rebuilds it).
bool spans_storage(const ViewLayout* layout, Py_ssize_t storage_nbytes) {
  if (layout->storage_offset != 0) return false;
  long long expected = 1;
  for (Py_ssize_t i = layout->ndim - 1; i >= 0; --i) {
    const long long size = layout->dims[i];
    // Every stride as view(size) makes it, a size-1 dimension's too: a backward may read
    // those (a memory format is told by them), and the rebuilt tensor must be the saved one.
    if (layout->dims[layout->ndim + i] != expected) return false;
    expected *= size;
  }
  return expected * layout->itemsize == storage_nbytes;
}

// `flat.view(*size)`: the size as separate arguments, which torch parses in about half the
// time of a tuple (docs/benchmarks.md *Hook cost*).
py::object view_as_size(const ViewLayout* layout, const py::object& flat) {
  constexpr Py_ssize_t kMaxArgs = 16;
  if (layout->ndim == 0 || layout->ndim > kMaxArgs)   // view(()) takes the tuple
    return call_with(attr(flat.ptr(), n_view).ptr(), layout_dims(layout, 0));
  PyObject* args[kMaxArgs + 1] = {flat.ptr()};
  Py_ssize_t made = 0;
  PyObject* out = nullptr;
  for (; made < layout->ndim; ++made) {
    args[made + 1] = PyLong_FromLongLong(layout->dims[made]);
    if (args[made + 1] == nullptr) break;
  }
  if (made == layout->ndim)
    out = PyObject_VectorcallMethod(n_view, args, (1 + made) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                    nullptr);
  for (Py_ssize_t i = 1; i <= made; ++i) Py_DECREF(args[i]);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// The layout over the flat tensor `bytes` without its bits (rebuild_over_flat): as the
// saved dtype (handed out so, or a view of it as that dtype), then the saved size, stride
// and offset over that. The whole storage as one contiguous dimension is that tensor
// itself: plain autograd too gives every save of one tensor the same tensor back. A storage
// whose size or offset is not a multiple of the dtype's size (bytes reinterpreted by a view
// of another dtype) is rebuilt over its storage.
py::object rebuild_flat(const ViewLayout* layout, const py::object& bytes,
                        Py_ssize_t byte_offset, Py_ssize_t storage_nbytes) {
  if (byte_offset % layout->itemsize != 0 || storage_nbytes % layout->itemsize != 0)
    return rebuild(layout, call_method(bytes.ptr(), names.untyped_storage), byte_offset);
  py::object typed = attr(bytes.ptr(), n_dtype).ptr() == layout->dtype
      ? bytes : call_with(attr(bytes.ptr(), n_view).ptr(), py::handle(layout->dtype));
  if (spans_storage(layout, storage_nbytes))   // a view of the whole storage (no strides)
    return layout->ndim == 1 ? typed : view_as_size(layout, typed);
  py::object size = layout_dims(layout, 0);
  py::object stride = layout_dims(layout, layout->ndim);
  py::object offset = py::reinterpret_steal<py::object>(
      PyLong_FromLongLong(byte_offset / layout->itemsize + layout->storage_offset));
  if (!offset) throw py::error_already_set();
  PyObject* args[] = {typed.ptr(), size.ptr(), stride.ptr(), offset.ptr()};
  PyObject* made = PyObject_VectorcallMethod(n_as_strided, args,
                                             4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (made == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(made);
}

}  // namespace

void configure_layout(PyObject* empty, PyObject* empty_strided, PyObject* neg_view) {
  Py_XSETREF(calls.empty, Py_NewRef(empty));
  Py_XSETREF(calls.empty_strided, Py_NewRef(empty_strided));
  Py_XSETREF(calls.neg_view, Py_NewRef(neg_view));
}

void read_layout(ViewLayout* layout, PyObject* t, PyObject* meta, long long storage_offset) {
  if (meta != Py_None) {
    layout->dtype = Py_NewRef(PyTuple_GET_ITEM(meta, 0));
    set_dims(layout, PyTuple_GET_ITEM(meta, 1), PyTuple_GET_ITEM(meta, 2));
    layout->storage_offset = PyLong_AsLongLong(PyTuple_GET_ITEM(meta, 3));
    layout->conj = PyTuple_GET_ITEM(meta, 4) == Py_True;
    layout->neg = PyTuple_GET_ITEM(meta, 5) == Py_True;
    PyObject* handed = PyTuple_GET_SIZE(meta) > 6 ? PyTuple_GET_ITEM(meta, 6) : Py_None;
    if (handed != Py_None) {
      if (!PyTuple_Check(handed) || PyTuple_GET_SIZE(handed) != layout->ndim) {
        PyErr_SetString(PyExc_TypeError, "offload: a snapshot's handed stride must be a "
                        "tuple of its size's length");
        throw py::error_already_set();
      }
      layout->handed_stride = Py_NewRef(handed);
    }
  } else {
    layout->dtype = attr(t, n_dtype).release().ptr();
    set_dims(layout, attr(t, n_shape).ptr(), call_method(t, n_stride).ptr());
    layout->storage_offset = storage_offset >= 0
        ? storage_offset : as_int(call_method(t, names.storage_offset));
    // Only a complex tensor has a conjugate bit (the check is one lookup per dtype).
    layout->conj = facts_of(layout->dtype).complex && call_method(t, n_is_conj).ptr() == Py_True;
    layout->neg = call_method(t, n_is_neg).ptr() == Py_True;
  }
  if (layout->storage_offset == -1 && PyErr_Occurred()) throw py::error_already_set();
  layout->itemsize = facts_of(layout->dtype).itemsize;
}

void clear_layout(ViewLayout* layout) {
  Py_CLEAR(layout->dtype);
  PyMem_Free(layout->dims);
  layout->dims = nullptr;
  Py_CLEAR(layout->handed_stride);
}

py::object layout_dims(const ViewLayout* layout, Py_ssize_t from) {
  py::object out = py::reinterpret_steal<py::object>(PyTuple_New(layout->ndim));
  if (!out) throw py::error_already_set();
  for (Py_ssize_t i = 0; i < layout->ndim; ++i) {
    PyObject* value = PyLong_FromLongLong(layout->dims[from + i]);
    if (value == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, value);
  }
  return out;
}

py::object rebuild_over_storage(const ViewLayout* layout, const py::object& storage,
                                Py_ssize_t byte_offset) {
  return with_bits(layout, with_handed_stride(layout, rebuild(layout, storage, byte_offset)));
}

py::object rebuild_over_flat(const ViewLayout* layout, const py::object& bytes,
                             Py_ssize_t byte_offset, Py_ssize_t storage_nbytes) {
  return with_bits(layout, with_handed_stride(
                               layout, rebuild_flat(layout, bytes, byte_offset, storage_nbytes)));
}

void init_layout_names() {
  n_dtype = intern("dtype");
  n_device = intern("device");
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
  n_copy = intern("copy_");
  kw_dtype_device = Py_BuildValue("(OO)", n_dtype, n_device);
  if (kw_dtype_device == nullptr) throw py::error_already_set();
}

}  // namespace offload::bind

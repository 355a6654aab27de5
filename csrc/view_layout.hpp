// A saved tensor's view layout over its stored bytes, in C: tensor_meta.ViewMeta's fields
// and tensor_meta.rebuild (view_layout.cpp). A MovedSave (moved_save.cpp) reads one at
// pack and rebuilds the tensor from it at unpack.
//
// Torch-independent like the rest of the front: the tensor is read and rebuilt through
// Python calls (`torch.empty`, `set_`, `view`, `as_strided`), the two torch functions set
// once by `configure_layout` (through saved_handles.py's configure_moved).
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

namespace offload::bind {

namespace py = pybind11;

struct ViewLayout {
  PyObject* dtype;
  // size then stride, `ndim` of each (PyMem_Malloc'd; null for a 0-d tensor): C numbers,
  // not tuples, which would be two more objects per save the collector counts.
  long long* dims;
  Py_ssize_t ndim;
  long long storage_offset;   // in elements
  long long itemsize;         // dtype's, in bytes
  // A snapshot's saved stride when its copy's differs (tensor_meta NOTE [Snapshot
  // strides]): the rebuilt tensor is handed out copied into one with these. The record's
  // own tuple (a reference, shared by its saves: no object per save); null otherwise.
  PyObject* handed_stride;
  char conj;
  char neg;
};

// The torch functions a rebuild calls: torch.empty, torch.empty_strided, torch._neg_view.
void configure_layout(PyObject* empty, PyObject* empty_strided, PyObject* neg_view);

// Fills `layout` (zero-filled, as a new handle's fields are) with `t`'s: from `meta` when it
// is a snapshot's layout, the tuple (dtype, size, stride, storage_offset, conj, neg,
// handed_stride) (tensor_meta.SnapshotMeta), else from `t` itself (None). `storage_offset`:
// t's, when the caller read it already; -1: read it. Throws py::error_already_set.
void read_layout(ViewLayout* layout, PyObject* t, PyObject* meta, long long storage_offset);

// Gives back what `layout` holds; it may be cleared twice.
void clear_layout(ViewLayout* layout);

// The saved size (`from` 0) or stride (`from` ndim) as a tuple.
py::object layout_dims(const ViewLayout* layout, Py_ssize_t from);

// tensor_meta.rebuild: the layout over `storage` (an UntypedStorage), whose bytes start at
// `byte_offset`, with the saved conjugate / negative bits.
py::object rebuild_over_storage(const ViewLayout* layout, const py::object& storage,
                                Py_ssize_t byte_offset);

// The layout over `bytes`, the flat tensor a CPU nvme payload was handed out as: its bytes
// start at `byte_offset` of a storage of `storage_nbytes` (see view_layout.cpp), with the
// saved bits.
py::object rebuild_over_flat(const ViewLayout* layout, const py::object& bytes,
                             Py_ssize_t byte_offset, Py_ssize_t storage_nbytes);

// Interns the names the layout reads and calls (at import, from bind_moved_save).
void init_layout_names();

}  // namespace offload::bind

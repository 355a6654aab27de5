// tensor_meta.StorageIndex for the core's records (saved_record.cpp): storages already
// stored during a step -> their record. Its own file: the records know only their entry
// (saved_record.hpp `IndexEntries`), the index finds and enters them through the records'
// functions.
//
// Written against the CPython API, as the records are: the move path (pack_moved.cpp)
// looks a storage up and enters it here for every stored storage, without a Python call.
#include "storage_index.hpp"

#include <Python.h>

#include <pybind11/pybind11.h>

#include <memory>
#include <new>

#include "bindings.hpp"
#include "py_type.hpp"
#include "saved_record.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// tensor_meta.StorageIndex for the core's records: storages already stored during a step ->
// their record (tensor_meta NOTE [Storage identity], NOTE [Versions]). A plain storage's
// entry lives in C and holds its record without a reference (the record takes the entry out
// when it dies): no weak-reference object per stored storage. An untracked alias's entries
// (keyed by its layout too: NOTE [Untracked aliases]) are rare and stay in a dict of weak
// references, as in the Python index.
struct StorageIndex {
  PyObject_HEAD
  std::shared_ptr<IndexEntries> entries;
  PyObject* by_layout;   // dict: (id(storage), layout) -> weakref to the record
};

PyObject* index_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self_obj = type->tp_alloc(type, 0);
  if (self_obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  new (&self->entries) std::shared_ptr<IndexEntries>(std::make_shared<IndexEntries>());
  self->by_layout = PyDict_New();
  if (self->by_layout == nullptr) {
    Py_DECREF(self_obj);
    return nullptr;
  }
  return self_obj;
}

void index_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  self->entries.~shared_ptr();   // records still alive find their entry gone
  Py_CLEAR(self->by_layout);
  Py_TYPE(self_obj)->tp_free(self_obj);
}

bool check_record(PyObject* obj) {
  if (is_record(obj)) return true;
  PyErr_Format(PyExc_TypeError, "offload: the core's StorageIndex holds the core's Record, "
               "not %s", Py_TYPE(obj)->tp_name);
  return false;
}

PyObject* layout_key(PyObject* storage, PyObject* layout) {
  PyObject* id = PyLong_FromVoidPtr(storage);
  if (id == nullptr) return nullptr;
  PyObject* key = PyTuple_Pack(2, id, layout);
  Py_DECREF(id);
  return key;
}

bool parse_args(const char* name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most) {
  if (nargs < least || nargs > most) {
    PyErr_Format(PyExc_TypeError, "StorageIndex.%s takes %zd to %zd arguments (%zd given)",
                 name, least, most, nargs);
    return false;
  }
  return true;
}

// lookup(storage, version, layout=None): the record of `storage` at `version` (and, for an
// untracked alias, `layout`), or None.
PyObject* index_lookup(PyObject* self_obj, PyObject* const* args, Py_ssize_t nargs) {
  if (!parse_args("lookup", nargs, 2, 3)) return nullptr;
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  PyObject* storage = args[0];
  const Py_ssize_t version = PyLong_AsSsize_t(args[1]);
  if (version == -1 && PyErr_Occurred()) return nullptr;
  PyObject* record = nullptr;
  if (nargs < 3 || args[2] == Py_None) {
    auto it = self->entries->map.find(storage);
    if (it != self->entries->map.end()) record = it->second;
  } else {
    PyObject* key = layout_key(storage, args[2]);
    if (key == nullptr) return nullptr;
    PyObject* ref = PyDict_GetItemWithError(self->by_layout, key);   // borrowed
    Py_DECREF(key);
    if (ref == nullptr) {
      if (PyErr_Occurred()) return nullptr;
    } else {
      PyObject* target = PyWeakref_GetObject(ref);
      if (target != Py_None) record = target;
    }
  }
  if (record == nullptr || !record_stored_as(record, storage, version)) Py_RETURN_NONE;
  return Py_NewRef(record);
}

// add(storage, version, record, layout=None): index `record` (made for `storage`).
PyObject* index_add(PyObject* self_obj, PyObject* const* args, Py_ssize_t nargs) {
  if (!parse_args("add", nargs, 3, 4)) return nullptr;
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  PyObject* storage = args[0];
  const Py_ssize_t version = PyLong_AsSsize_t(args[1]);
  if (version == -1 && PyErr_Occurred()) return nullptr;
  if (!check_record(args[2])) return nullptr;
  if (nargs < 4 || args[3] == Py_None) {
    record_indexed(args[2], version, &self->entries, storage);
  } else {
    PyObject* key = layout_key(storage, args[3]);
    if (key == nullptr) return nullptr;
    PyObject* ref = PyWeakref_NewRef(args[2], nullptr);
    const int failed = ref == nullptr ? -1 : PyDict_SetItem(self->by_layout, key, ref);
    Py_DECREF(key);
    Py_XDECREF(ref);
    if (failed) return nullptr;
    record_indexed(args[2], version, nullptr, storage);
  }
  Py_RETURN_NONE;
}

PyObject* index_clear(PyObject* self_obj, PyObject*) {
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  self->entries->map.clear();
  PyDict_Clear(self->by_layout);
  Py_RETURN_NONE;
}

Py_ssize_t index_len(PyObject* self_obj) {
  auto* self = reinterpret_cast<StorageIndex*>(self_obj);
  return static_cast<Py_ssize_t>(self->entries->map.size()) + PyDict_GET_SIZE(self->by_layout);
}

PyMethodDef index_methods[] = {
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_lookup)),
     METH_FASTCALL, "lookup(storage, version, layout=None): the record, or None."},
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(index_add)),
     METH_FASTCALL, "add(storage, version, record, layout=None): index the record."},
    {"clear", index_clear, METH_NOARGS, "Forget every entry."},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods index_as_sequence = length_only(index_len);

PyTypeObject index_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.StorageIndex", sizeof(StorageIndex),
      "Storages already stored during a step -> their core Record (tensor_meta.StorageIndex "
      "for the core's records).",
      index_new, index_dealloc);
  type.tp_methods = index_methods;
  type.tp_as_sequence = &index_as_sequence;
  return type;
}();

}  // namespace

bool is_storage_index(PyObject* obj) { return Py_TYPE(obj) == &index_type; }

PyObject* index_find(PyObject* index_obj, PyObject* storage, long long version) {
  auto* index = reinterpret_cast<StorageIndex*>(index_obj);
  auto it = index->entries->map.find(storage);
  if (it == index->entries->map.end() || !record_stored_as(it->second, storage, version))
    return nullptr;
  return Py_NewRef(it->second);
}

void index_put(PyObject* index_obj, PyObject* storage, long long version, PyObject* record) {
  record_indexed(record, version, &reinterpret_cast<StorageIndex*>(index_obj)->entries, storage);
}

void bind_storage_index(py::module_& m) {
  add_type(m, "StorageIndex", index_type);
}

}  // namespace offload::bind

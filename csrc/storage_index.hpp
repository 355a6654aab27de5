// The core's StorageIndex (storage_index.cpp), as the move path (pack_moved.cpp) uses it
// without a Python call.
#pragma once

#include <Python.h>

namespace offload::bind {

// The record of `storage` at `version` in the core's StorageIndex `index` (a new
// reference), or nullptr (no error set) when it has none; tensor_meta NOTE [Storage identity].
PyObject* index_find(PyObject* index, PyObject* storage, long long version);
// Whether `obj` is the core's StorageIndex.
bool is_storage_index(PyObject* obj);
// Indexes `record` (made for `storage`) at `version`.
void index_put(PyObject* index, PyObject* storage, long long version, PyObject* record);

}  // namespace offload::bind

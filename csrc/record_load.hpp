// records.py `load` in C, for the core's records (record_load.cpp): a CPU nvme payload's
// bytes loaded through the record's unpack cache (records.py NOTE [Unpack cache]) and the
// core's Prefetcher without a Python call. A MovedSave (moved_save.cpp) loads through it.
#pragma once

#include <Python.h>

namespace offload::bind {

// records.py `load` for the core's `record`: its bytes, loaded at most once while they are
// needed, and their byte offset. A CPU nvme payload's in C, as the flat tensor the tier
// handed out (`*flat` set; the record's cache holds that tensor): of `dtype` when it loads
// them now and `dtype` is not null (the storage's nbytes a multiple of its size), else
// uint8, and a cached one of whatever dtype its first load gave it; any other's through
// `py_load` (records.load), as their storage. `*written`: the in-place changes made to a
// cached flat tensor since it was loaded, through the saves it was handed to (records.py
// NOTE [Writes into a shared copy]); 0 for a fresh load and for anything else. A new
// reference, or nullptr with a Python error set.
PyObject* record_load(PyObject* record, PyObject* py_load, Py_ssize_t* offset, bool* flat,
                      PyObject* dtype, long long* written);

}  // namespace offload::bind

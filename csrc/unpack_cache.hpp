// A core Record's unpack cache, in C (records.py NOTE [Unpack cache]): what the record holds
// of its loaded bytes while saves of its storage are still to be unpacked, and the load of
// a CPU nvme payload's bytes without a Python call (unpack_cache.cpp). The record
// (saved_record.cpp) holds the cache; a MovedSave (moved_save.cpp) loads through it.
#pragma once

#include <Python.h>

namespace offload::bind {

struct UnpackCache {
  Py_ssize_t handles_left;   // saved tensors of the record not yet unpacked
  PyObject* cache;           // the loaded storage (None once they all were) ...
  PyObject* cache_ref;       // ... and a weak reference to it (None before the first load)
  Py_ssize_t cache_offset;   // the loaded bytes' offset in `cache`
  PyObject* shared;          // a CUDA storage's streams (records.py)
};

// A new record's cache: empty.
void init_cache(UnpackCache* cache);
// Gives back what `cache` holds.
void clear_cache(UnpackCache* cache);

// records.py `load` for the core's `record`: its bytes, loaded at most once while they are
// needed, and their byte offset. A CPU nvme payload's in C, as the flat tensor the tier
// handed out (`*flat` set; the record's cache holds that tensor): of `dtype` when it loads
// them now and `dtype` is not null (the storage's nbytes a multiple of its size), else
// uint8, and a cached one of whatever dtype its first load gave it; any other's through
// `py_load` (records.load), as their storage. A new reference, or nullptr with a Python
// error set.
PyObject* record_load(PyObject* record, PyObject* py_load, Py_ssize_t* offset, bool* flat,
                      PyObject* dtype);

}  // namespace offload::bind

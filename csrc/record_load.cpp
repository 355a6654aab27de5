// records.py `load` for the core's records (record_load.hpp): a CPU nvme payload's bytes
// through the core's Prefetcher, or the tier, without a Python call; records.load for any
// other payload.
#include <Python.h>

#include "nvme_payload.hpp"
#include "prefetcher.hpp"
#include "py_calls.hpp"
#include "record_load.hpp"
#include "saved_record.hpp"

namespace offload::bind {

namespace {

// `t._version`, or -1 with a Python error set.
long long tensor_version(PyObject* t) {
  PyObject* v = PyObject_GetAttr(t, names.version);
  if (v == nullptr) return -1;
  const long long out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return out;
}

// records.load(record): (storage, byte offset).
PyObject* load_in_python(PyObject* record, PyObject* py_load, Py_ssize_t* offset) {
  PyObject* argv[] = {record};
  PyObject* got = PyObject_Vectorcall(py_load, argv, 1, nullptr);
  if (got == nullptr) return nullptr;
  PyObject* storage = Py_NewRef(PyTuple_GET_ITEM(got, 0));
  *offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1));
  Py_DECREF(got);
  if (*offset == -1 && PyErr_Occurred()) Py_CLEAR(storage);
  return storage;
}

}  // namespace

PyObject* record_load(PyObject* record, PyObject* py_load, Py_ssize_t* offset, bool* flat,
                      PyObject* dtype, long long* written) {
  UnpackCache* cache = record_cache(record);
  PyObject* payload = record_payload(record);
  PyObject* prefetcher = record_prefetcher(record);
  *flat = false;
  *written = 0;
  // In C only what a CPU nvme payload holds (no CUDA stream hand-off to make: copies Note
  // 12); anything else is records.load's. Only this function loads such a record (the
  // core's handles are all that hold one), so its cache holds the tier's tensor.
  // (A prefetcher that is not the core's is records.load's too.)
  if (!is_payload(payload) || reinterpret_cast<NvmePayload*>(payload)->cuda ||
      (prefetcher != Py_None && !is_prefetcher(prefetcher)))
    return load_in_python(record, py_load, offset);
  // Only the strong cache is used again: a copy handed out earlier may be a gradient by now
  // (records.py NOTE [One tensor per layout]), so an unpack after they all were loads afresh.
  PyObject* storage = cache->cache != Py_None ? Py_NewRef(cache->cache) : nullptr;
  if (storage == nullptr) {
    // A released payload or a closed tier: records.load raises the error it says.
    if (reinterpret_cast<NvmePayload*>(payload)->released)
      return load_in_python(record, py_load, offset);
    PyObject* tier = record_tier(record);
    PyObject* closed = PyObject_GetAttr(tier, names.closed);
    if (closed == nullptr) return nullptr;
    Py_DECREF(closed);
    if (closed != Py_False) return load_in_python(record, py_load, offset);
    if (!record_unpacked(record)) return nullptr;
    Py_ssize_t byte_offset = 0;   // the core prefetcher's hand-out starts its storage
    if (prefetcher == Py_None) {   // the tier's (uint8, wherever it starts)
      storage = PyObject_CallMethodOneArg(tier, names.fetch, payload);
      if (storage == nullptr) return nullptr;
      PyObject* off = PyObject_CallMethodNoArgs(storage, names.storage_offset);
      byte_offset = off != nullptr ? PyLong_AsSsize_t(off) : -1;
      Py_XDECREF(off);
    } else {   // no Python
      storage = prefetcher_fetch(prefetcher, tier, payload, dtype);
      if (storage == nullptr) return nullptr;
    }
    if (PyErr_Occurred()) {
      Py_XDECREF(storage);
      return nullptr;
    }
    cache->cache_offset = byte_offset;
    cache->cache_version = tensor_version(storage);
    if (cache->cache_version < 0) {
      Py_DECREF(storage);
      return nullptr;
    }
  } else {   // handed out before: its saves share its version counter (views of it)
    const long long now = tensor_version(storage);
    if (now < 0) {
      Py_DECREF(storage);
      return nullptr;
    }
    *written = now - cache->cache_version;
  }
  if (cache->handles_left > 1) Py_XSETREF(cache->cache, Py_NewRef(storage));
  *offset = cache->cache_offset;
  *flat = true;
  return storage;
}

}  // namespace offload::bind

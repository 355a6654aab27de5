// What the hooks' C front (hook_front.cpp, hook_unpacker.cpp, pack_moved.cpp), the
// storage index (storage_index.cpp) and the C load (record_load.cpp) read and set of the
// core's records (saved_record.cpp) directly, without a Python call.
#pragma once

#include <Python.h>

#include <memory>
#include <unordered_map>

namespace offload::bind {

// A StorageIndex's entries (storage_index.cpp): a storage (its Python object's address) ->
// the core Record stored for it. The entries do not own their records: a record takes its
// entry out when it dies, so an entry always names a live record.
struct IndexEntries {
  std::unordered_map<PyObject*, PyObject*> map;
};

// A record's unpack cache (records.py NOTE [Unpack cache]): what it holds of its loaded
// bytes while saves of its storage are still to be unpacked (record_load.cpp fills it).
struct UnpackCache {
  Py_ssize_t handles_left;   // saved tensors of the record not yet unpacked
  PyObject* cache;           // the loaded storage (None once they all were)
  Py_ssize_t cache_offset;   // the loaded bytes' offset in `cache`
  long long cache_version;   // a CPU nvme payload's flat tensor's version when loaded
  //                            (records.py NOTE [Writes into a shared copy])
  PyObject* shared;          // a CUDA storage's streams (records.py)
  // Layout key -> the tensor handed out for it, while `cache` holds (records.py NOTE [One
  // tensor per layout]): a dict, or nullptr / None (records.py sets it) for none yet.
  PyObject* handed;
};

// Whether `record` is the core's Record and has a payload in a tier.
bool record_holds_space(PyObject* record);

// Whether `obj` is the core's Record / the Record type itself.
bool is_record(PyObject* obj);
bool is_record_type(PyObject* obj);

// The core's Record's fields the move path reads (borrowed), for `record` of the core's type.
PyObject* record_tier(PyObject* record);
PyObject* record_payload(PyObject* record);
PyObject* record_meta(PyObject* record);
PyObject* record_prefetcher(PyObject* record);
// Its unpack cache (record_load reads and fills it).
UnpackCache* record_cache(PyObject* record);
bool record_resident(PyObject* record);

// A saved tensor of `record` was made (`Moved`) / unpacked or died unpacked (records.py
// `handle_done`: the unpack cache lets go once every save of the storage was unpacked).
void record_handle_added(PyObject* record);
void record_handle_done(PyObject* record);

// Whether the core's `record` was indexed for `storage` at `version`, and the storage is
// still the one it was made for (tensor_meta NOTE [Storage identity]).
bool record_stored_as(PyObject* record, PyObject* storage, long long version);
// The core's `record` is indexed at `version`: under `storage` in `entries` (leaving the
// entry that named it before), or, `entries` null, in an index that keeps it elsewhere
// (an untracked alias's, by layout).
void record_indexed(PyObject* record, long long version,
                    const std::shared_ptr<IndexEntries>* entries, PyObject* storage);

// A row on the core's `timeline` for `record`, packed now as the `position`-th stored
// storage; false with a Python error set (also when `timeline` is not the core's: a core
// record is only ever timed on one, so its unpacks are noted without a Python call).
bool record_timed(PyObject* record, PyObject* timeline, long long position);
// The first unpack of `record`'s storage on its timeline, if it is timed; false with a
// Python error set.
bool record_unpacked(PyObject* record);

// The bytes of the storage `record` was made for.
Py_ssize_t record_nbytes(PyObject* record);

}  // namespace offload::bind

// The packer's move path (pack_moved.cpp): a saved CPU tensor that the standing decision
// sends to a tier with a store in C (the nvme tier's or the host tier's `store_cpu`) is
// stored, recorded, indexed and handed to autograd as a MovedSave (or, when it stays, its
// record) with no Python frame.
// Every other case, and every case it is not sure of, goes on to the Python hooks
// (hooks.py NOTE [Move path in C]).
#pragma once

#include <Python.h>

#include <memory>

#include "saved_bytes.hpp"

namespace offload::bind {

// What the move path reads, given by the hooks when the packer is made: the step's objects
// that refer to nothing of the step's (strong references, visited by the packer's
// garbage-collector slots). The placement and the tiers are read from the hooks' storer
// (storing.py) per save: the tiers hold the step (its copy streams), which holds the hooks,
// and a packer that outlives its hooks must not keep them alive.
struct MovePath {
  PyObject* index = nullptr;          // the core's StorageIndex
  PyObject* timeline = nullptr;       // the step's Timeline
  PyObject* prefetcher = nullptr;
  PyObject* lock = nullptr;           // the hooks' lock (index, caches)
  PyObject* param_ids = nullptr;      // ParamStorages._ids: id(storage) -> weakref
  PyObject* no_offload = nullptr;     // no_offload's thread-local depth
  PyObject* graph_task_id = nullptr;  // torch._C._current_graph_task_id
  PyObject* empty = nullptr;          // a zero-byte CPU tensor (the sentinels' data)
  PyObject* cpu_device = nullptr;     // torch.device("cpu")

  bool configured() const { return index != nullptr; }
  int visit(visitproc visit, void* arg) const;
  void clear();
};

// What `_pack_plain` returns for `t` (its storage `storage` of `nbytes`, grad_fn `node` not
// None, `version`) when the move path takes it, a new reference: a MovedSave when its bytes
// moved, else its storage's record (the tensor stays with it: the host tier's StorageRef,
// a storage kept, found in the index), which the packer makes a KeptSave of. nullptr with
// no error set when it does not (the caller goes on to the Python hooks, which redo every
// test: nothing was changed); nullptr with an error set on failure. `owner`: the hooks
// (their `storer`: its placement, tiers and `stored` position counter), `record_type`,
// `meter`: the step's records and meter.
PyObject* pack_moved(const MovePath& path, PyObject* owner, PyObject* t, PyObject* storage,
                     long long nbytes, PyObject* node, long long version, long long min_bytes,
                     PyObject* record_type, PyObject* meter_obj, SavedBytes* meter,
                     PyObject* next_sequence_nr);

}  // namespace offload::bind

// The packer's move path (pack_moved.hpp; hooks.py NOTE [Move path in C]).
//
// The same tests as hooks.py's `_pack_strided` → `_pack_plain` → `Storer.store` (storing.py),
// in their order, for the one case it takes: a plain CPU activation (not a weight, not an
// untracked alias, not saved in a backward or under no_offload) whose storage the standing
// decision sends to a tier that stores CPU storages in C. Each test that does not hold
// returns "not taken" before anything changed, so the Python path, which redoes all of
// them, decides as it would have. What it then does is what `Storer.store` does: the next
// position, the tier's store, the record (counting itself into the meter), the
// prefetcher's order (a payload that left the device's memory), the timeline's row, the
// index entry; then a MovedSave (moved_save.cpp) for bytes that moved, or the record itself
// for a tensor that stays with it (the host tier's StorageRef on a CPU run), as
// `_pack_plain` returns it.
#include "pack_moved.hpp"

#include <Python.h>

#include <pybind11/pybind11.h>

#include "moved_save.hpp"
#include "prefetcher.hpp"
#include "py_calls.hpp"
#include "saved_record.hpp"
#include "storage_index.hpp"
#include "storage_ref.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct MoveNames {
  PyObject* standing;
  PyObject* round_trip;
  PyObject* keep;
  PyObject* targets;
  PyObject* store_cpu;
  PyObject* is_cpu;
  PyObject* is_quantized;
  PyObject* is_nested;
  PyObject* numel;
  PyObject* is_zerotensor;
  PyObject* requires_grad;
  PyObject* depth;
  PyObject* stored;
  PyObject* placement;
  PyObject* tiers;
  PyObject* storer;
};

MoveNames& move_names() {
  static MoveNames n = {intern("standing"),      intern("round_trip"), intern("keep"),
                        intern("targets"),       intern("store_cpu"),  intern("is_cpu"),
                        intern("is_quantized"),  intern("is_nested"),  intern("numel"),
                        intern("_is_zerotensor"), intern("requires_grad"), intern("depth"),
                        intern("stored"),        intern("placement"),  intern("tiers"),
                        intern("storer")};
  return n;
}

bool is_true(const py::object& value) { return value.ptr() == Py_True; }

// Whether `t` passes hooks.py's tests up to the index (movable_strided, not a weight, not in
// a backward or no_offload, not an untracked alias). Reads only; gives back what it read
// that the handle needs too: `t._base`, and t's storage offset when it read it (else -1).
bool eligible(const MovePath& path, const MoveNames& n, PyObject* t, PyObject* storage,
              long long nbytes, py::object* base_out, long long* t_offset) {
  if (is_true(attr(t, n.is_quantized)) ||
      is_true(attr(t, n.is_nested)) || as_int(call_method(t, n.numel)) == 0 ||
      is_true(call_method(t, n.is_zerotensor)))
    return false;
  // is_weight for a tensor with a grad_fn: a view of a leaf that requires grad.
  py::object& base = *base_out;
  base = attr(t, names.base);
  if (!base.is_none() && is_true(attr(base.ptr(), names.is_leaf)) &&
      is_true(attr(base.ptr(), n.requires_grad)))
    return false;
  if (PyDict_GET_SIZE(path.param_ids) != 0) {   // model='s parameters and buffers
    py::object key = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(storage));
    if (!key) throw py::error_already_set();
    PyObject* ref = PyDict_GetItemWithError(path.param_ids, key.ptr());   // borrowed
    if (ref == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (ref != nullptr) return false;   // the Python path checks the reference
  }
  if (as_int(call(path.graph_task_id)) >= 0) return false;   // saved during a backward
  if (as_int(attr(path.no_offload, n.depth)) > 0) return false;
  // tensor_meta NOTE [Untracked aliases]: the counter's owner spans the storage exactly.
  PyObject* owner = base.is_none() ? t : base.ptr();
  const long long owner_offset = as_int(call_method(owner, names.storage_offset));
  if (owner == t) *t_offset = owner_offset;
  return owner_offset == 0 && as_int(attr(owner, names.nbytes)) == nbytes;
}

// A record of the index that holds moved bytes: a MovedSave of it is what Python's
// `_pack_plain` returns for it (not a kept record, nor a resident one without a layout).
bool holds_moved_bytes(PyObject* record) {
  return record_payload(record) != Py_None &&
         !(record_resident(record) && record_meta(record) == Py_None);
}

// The standing decision's first tier's `store_cpu` when it stores CPU storages in C (with
// `*placement` and `*tier`), else an empty object. `storer`: the hooks' Storer.
py::object c_store(const MoveNames& n, PyObject* storer, py::object* placement, py::object* tier) {
  // placement.py NOTE [Standing decision]: None while forced, and for the scheduler's.
  *placement = attr(storer, n.placement);
  py::object standing = attr(placement->ptr(), n.standing);
  if (standing.is_none()) return {};
  py::object targets = attr(standing.ptr(), n.targets);
  if (!PyTuple_Check(targets.ptr()) || PyTuple_GET_SIZE(targets.ptr()) == 0) return {};
  py::object tiers = attr(storer, n.tiers);
  if (!PyDict_Check(tiers.ptr())) return {};
  PyObject* found = PyDict_GetItemWithError(tiers.ptr(), PyTuple_GET_ITEM(targets.ptr(), 0));
  if (found == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return {};
  }
  *tier = py::reinterpret_borrow<py::object>(found);
  py::object store_cpu = attr(found, n.store_cpu);
  return store_cpu.is_none() ? py::object() : store_cpu;   // None: not open for it
}

// `Storer.store` for the storage through `store_cpu` (its tier `tier`): its record (a new
// reference), or nullptr (no error) when the plan keeps it or the tier is full.
PyObject* store(const MovePath& path, const MoveNames& n, PyObject* placement, PyObject* tier,
                PyObject* store_cpu, PyObject* storer, PyObject* storage, long long nbytes,
                PyObject* record_type, PyObject* meter_obj) {
  py::object position_obj = attr(storer, n.stored);
  const long long position = as_int(position_obj);
  py::object round_trip = attr(placement, n.round_trip);
  py::object keep = round_trip.is_none() ? py::object() : attr(round_trip.ptr(), n.keep);
  // The plan keeps (position, nbytes)? Nothing to ask of an empty set.
  if (keep && !(PyAnySet_Check(keep.ptr()) && PySet_GET_SIZE(keep.ptr()) == 0)) {
    py::object key = py::reinterpret_steal<py::object>(Py_BuildValue("(OL)", position_obj.ptr(), nbytes));
    if (!key) throw py::error_already_set();
    const int kept = PySequence_Contains(keep.ptr(), key.ptr());
    if (kept < 0) throw py::error_already_set();
    if (kept) return nullptr;
  }
  // The storage's device: the CPU's (eligible() took only CPU tensors).
  py::object payload = call_with(store_cpu, py::handle(storage), py::handle(path.cpu_device));
  if (payload.is_none()) return nullptr;   // full: the Python path spills (and retries it)
  py::object next = py::reinterpret_steal<py::object>(PyLong_FromLongLong(position + 1));
  if (!next || PyObject_SetAttr(storer, n.stored, next.ptr()) < 0) throw py::error_already_set();
  // The record counts the storage into the step's meter, as the tier's (NOTE [Record
  // lifetime]). A tier's store in C returns a StorageRef (resident: nothing to reload) or a
  // payload that left the device's memory, which the prefetcher brings back (Tier.store_cpu).
  const bool resident = is_storage_ref(payload.ptr());
  PyObject* prefetcher = resident ? Py_None : path.prefetcher;
  py::object nbytes_obj = py::reinterpret_steal<py::object>(PyLong_FromLongLong(nbytes));
  if (!nbytes_obj) throw py::error_already_set();
  py::object record = call_with(record_type, py::handle(storage), py::handle(tier), payload,
                                nbytes_obj, py::handle(resident ? Py_True : Py_False),
                                py::handle(Py_None), py::handle(meter_obj),
                                py::handle(prefetcher));
  if (!resident && !prefetcher_register(path.prefetcher, tier, payload.ptr()))
    throw py::error_already_set();   // its place in pack order
  if (!record_timed(record.ptr(), path.timeline, position)) throw py::error_already_set();
  return record.release().ptr();
}

}  // namespace

int MovePath::visit(visitproc visit_fn, void* arg) const {
  for (PyObject* obj : {index, timeline, prefetcher, lock, param_ids,
                        no_offload, graph_task_id, empty, cpu_device})
    if (obj != nullptr) {
      const int got = visit_fn(obj, arg);
      if (got != 0) return got;
    }
  return 0;
}

void MovePath::clear() {
  for (PyObject** obj : {&index, &timeline, &prefetcher, &lock, &param_ids,
                         &no_offload, &graph_task_id, &empty, &cpu_device})
    Py_CLEAR(*obj);
}

PyObject* pack_moved(const MovePath& path, PyObject* owner, PyObject* t, PyObject* storage,
                     long long nbytes, PyObject* node, long long version, long long min_bytes,
                     PyObject* record_type, PyObject* meter_obj, SavedBytes* meter,
                     PyObject* next_sequence_nr) {
  return guarded([&]() -> PyObject* {
    const MoveNames& n = move_names();
    if (nbytes < min_bytes) return nullptr;   // the placement keeps it
    // The first of eligible()'s tests, first: a GPU run's saves leave at once.
    if (!is_true(attr(t, n.is_cpu))) return nullptr;
    py::object storer = attr(owner, n.storer);
    py::object placement, tier;
    py::object store_cpu = c_store(n, storer.ptr(), &placement, &tier);
    if (!store_cpu) return nullptr;
    py::object base;
    long long t_offset = -1;
    if (!eligible(path, n, t, storage, nbytes, &base, &t_offset)) return nullptr;
    py::object record;
    {
      // The hooks' lock: the index and the tier's queues are shared with autograd's other
      // threads, and the tier's store may let go of the GIL while it waits.
      PyLockHeld locked(path.lock);
      PyObject* found = index_find(path.index, storage, version);
      if (found != nullptr) {
        record = py::reinterpret_steal<py::object>(found);
      } else {
        PyObject* stored = store(path, n, placement.ptr(), tier.ptr(), store_cpu.ptr(),
                                 storer.ptr(), storage, nbytes, record_type, meter_obj);
        if (stored == nullptr) return nullptr;
        record = py::reinterpret_steal<py::object>(stored);
        index_put(path.index, storage, version, record.ptr());
      }
    }
    // A tensor that stays (a kept storage, or one the tier holds by reference): its
    // record, which the packer holds it with, as `_pack_plain` returns it.
    if (!holds_moved_bytes(record.ptr())) return record.release().ptr();
    PyObject* save = new_moved_save(t, record.ptr(), node, base.ptr(), version,
                                    next_sequence_nr, path.empty, t_offset);
    if (save == nullptr) throw py::error_already_set();
    meter->offloaded();
    return save;
  });
}

}  // namespace offload::bind

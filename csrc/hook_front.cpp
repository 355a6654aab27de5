// The pack hook torch calls, in C: the Python class Packer (hooks.py NOTE [Handles in C]).
// It makes the handles of saved tensors that stay (saved_handles.cpp), stores what its move
// path takes (pack_moved.cpp), and hands everything else to the Python hooks with what it
// read. Its counterpart, the Unpacker, is hook_unpacker.cpp.
//
// Still torch-independent: the tensor is only touched through Python attribute lookups
// (`_version`, `grad_fn`, `untyped_storage()`...), exactly what the Python path reads, so
// one build works with every torch version. Everything here runs with the GIL held (torch
// calls the hooks with it).
//
// Written against the CPython API, not pybind11: torch calls the hooks through vectorcall,
// and a pybind11 call costs an argument dispatch, several hundred ns per save
// (docs/benchmarks.md *Hook cost*). The packer is tracked by the garbage collector (its
// move path holds the step's placement, tiers and prefetcher: one object per step, so
// tracking it costs nothing per save).
#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <exception>
#include <new>

#include "bindings.hpp"
#include "forks.hpp"
#include "pack_moved.hpp"
#include "prefetcher.hpp"
#include "storage_index.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "saved_bytes.hpp"
#include "saved_handles.hpp"
#include "saved_record.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// The pack hook. A small save is made here; a plain strided tensor that is not one goes on
// to `strided(owner, tensor, version, storage, nbytes, node)` with what was read here
// (hooks.py's `_pack_strided`), which returns the handle, or what this makes a KeptSave of:
// a Record (the tensor stays; its storage's record) or None (a weight that stays).
// Anything else goes to `full(owner, tensor)` (`pack_full`). With a move path (the hooks'
// NOTE [Move path in C]) a CPU activation its standing decision sends to a tier with a
// store in C is stored here: pack_moved gives the handle, or the record it stays with.
struct Packer {
  Callable head;
  // The hooks object whose pack this is (a weak reference: the hooks hold this packer, and
  // its identity marks their entry on torch's hook stack).
  PyObject* owner_ref;
  PyObject* full;
  PyObject* strided_pack;
  std::shared_ptr<SavedBytes> meter;   // constructed in packer_new
  long long min_bytes;
  PyObject* tensor_type;
  PyObject* strided;
  PyObject* profiling;
  PyObject* next_sequence_nr;
  PyObject* record_type;
  PyObject* meter_obj;       // the meter's Python object (what a record counts itself into)
  MovePath moves;            // empty: no move path (pack_moved.hpp)
  // fork_generation (forks.hpp) when it was made; -1 once retired. Another than the
  // process's: every save goes to the Python path, which holds it as it is (hooks.py
  // `_Forks`; offload/process.py's table, "forked child").
  long long generation;
};

// The owner, or (None) an error saying the context is gone.
py::object packer_owner(const Packer* self) {
  py::object owner = call(self->owner_ref);
  if (owner.is_none()) {
    PyErr_SetString(PyExc_RuntimeError,
                    "offload: a saved-tensor pack hook was called after its "
                    "offload.activations() context was freed");
    throw py::error_already_set();
  }
  return owner;
}

// What saved_handles.Kept holds, the same way: the tensor as autograd holds it, or for an output
// of the saving node a detached alias (breaks the tensor -> node -> save cycle) and that
// node's name (`saving_node`: version_check.py).
void hold(const Packer* self, HeldTensor* save, PyObject* t, const py::object& node,
          const py::object& version) {
  save->version = as_int(version);
  const bool is_output = saving_node(node.ptr(), self->next_sequence_nr);
  if (is_output) {
    save->tensor = call_method(t, names.detach).release().ptr();
    save->node_name =
        attr(reinterpret_cast<PyObject*>(Py_TYPE(node.ptr())), names.name).release().ptr();
    save->output_nr = as_int(attr(t, names.output_nr));
  } else {
    save->tensor = Py_NewRef(t);
    save->node_name = Py_NewRef(Py_None);
    save->output_nr = 0;
  }
}

PyObject* pack(const Packer* self, PyObject* t) {
  // The same tests, in the same order, as hooks.py's `_pack` step 1.
  if (reinterpret_cast<PyObject*>(Py_TYPE(t)) != self->tensor_type ||
      self->generation != fork_generation || profiler_on(self->profiling) ||
      attr(t, names.layout).ptr() != self->strided)
    return call_with(self->full, packer_owner(self), py::handle(t)).release().ptr();
  PyObject* storage_ptr = PyObject_CallMethodNoArgs(t, names.untyped_storage);
  if (storage_ptr == nullptr) {
    // No storage of its own (torch.func's wrappers under jvp / vmap): pack_full keeps it.
    if (!PyErr_ExceptionMatches(PyExc_NotImplementedError)) throw py::error_already_set();
    PyErr_Clear();
    return call_with(self->full, packer_owner(self), py::handle(t)).release().ptr();
  }
  py::object storage = py::reinterpret_steal<py::object>(storage_ptr);
  py::object nbytes_obj = call_method(storage.ptr(), names.nbytes);
  const long long nbytes = as_int(nbytes_obj);
  py::object node = attr(t, names.grad_fn);
  py::object version = attr(t, names.version);
  // A leaf (no grad_fn) or a view of one may be a weight: step 2 tells.
  bool small = nbytes < self->min_bytes && !node.is_none();
  if (small) {
    py::object base = attr(t, names.base);
    small = base.is_none() || attr(base.ptr(), names.is_leaf).ptr() != Py_True;
  }
  if (small) {
    auto save = py::reinterpret_steal<py::object>(
        reinterpret_cast<PyObject*>(new_handle<SmallSave>(&small_save_type)));
    auto* fields = reinterpret_cast<SmallSave*>(save.ptr());
    new (&fields->meter) std::shared_ptr<SavedBytes>();
    hold(self, &fields->held, t, node, version);
    fields->key = reinterpret_cast<uintptr_t>(storage.ptr());
    fields->meter = self->meter;
    self->meter->small_saved(fields->key, nbytes);
    self->meter->packed();
    return save.release().ptr();
  }
  py::object owner = packer_owner(self);
  self->meter->packed();
  py::object got;
  if (self->moves.configured() && !node.is_none()) {
    PyObject* taken = pack_moved(self->moves, owner.ptr(), t, storage.ptr(), nbytes, node.ptr(),
                                 as_int(version), self->min_bytes, self->record_type,
                                 self->meter_obj, self->meter.get(), self->next_sequence_nr);
    if (taken != nullptr) got = py::reinterpret_steal<py::object>(taken);
    else if (PyErr_Occurred()) throw py::error_already_set();
  }
  if (!got)
    got = call_with(self->strided_pack, owner, py::handle(t), version, storage, nbytes_obj, node);
  if (!got.is_none() &&
      reinterpret_cast<PyObject*>(Py_TYPE(got.ptr())) != self->record_type)
    return got.release().ptr();  // a finished handle (moved, or not a plain strided tensor)
  // A resident record's payload is the storage itself (hooks.py `_handle` counts the same).
  if (!got.is_none() && record_holds_space(got.ptr())) self->meter->offloaded();
  auto save = py::reinterpret_steal<py::object>(
      reinterpret_cast<PyObject*>(new_handle<KeptSave>(&kept_save_type)));
  auto* fields = reinterpret_cast<KeptSave*>(save.ptr());
  fields->record = got.release().ptr();   // set first: the handle owns it from here on
  hold(self, &fields->held, t, node, version);
  return save.release().ptr();
}

PyObject* packer_vectorcall(PyObject* obj, PyObject* const* args, size_t nargsf,
                            PyObject* kwnames) {
  if (!one_argument("pack", nargsf, kwnames)) return nullptr;
  return guarded([&] { return pack(reinterpret_cast<Packer*>(obj), args[0]); });
}

PyObject* packer_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {
      "owner_ref", "full", "strided_pack", "meter", "min_bytes", "tensor_type", "strided",
      "profiling", "next_sequence_nr", "record_type",
      // The move path (all or none): pack_moved.hpp's MovePath.
      "index", "timeline", "prefetcher", "lock", "param_ids", "no_offload", "graph_task_id",
      "empty", "cpu_device", nullptr};
  PyObject *owner_ref, *full, *strided_pack, *meter, *tensor_type, *strided, *profiling,
      *next_sequence_nr, *record_type;
  long long min_bytes;
  MovePath moves;   // borrowed until the packer takes them
  if (!PyArg_ParseTupleAndKeywords(
          args, kwargs, "OOOOLOOOOO|$OOOOO!OOOO", const_cast<char**>(keywords), &owner_ref,
          &full, &strided_pack, &meter, &min_bytes, &tensor_type, &strided, &profiling,
          &next_sequence_nr, &record_type, &moves.index, &moves.timeline, &moves.prefetcher,
          &moves.lock, &PyDict_Type, &moves.param_ids, &moves.no_offload, &moves.graph_task_id,
          &moves.empty, &moves.cpu_device))
    return nullptr;
  const bool any_move = moves.index != nullptr || moves.timeline != nullptr ||
                        moves.prefetcher != nullptr || moves.lock != nullptr ||
                        moves.param_ids != nullptr || moves.no_offload != nullptr ||
                        moves.graph_task_id != nullptr || moves.empty != nullptr ||
                        moves.cpu_device != nullptr;
  if (any_move && (moves.index == nullptr || moves.timeline == nullptr ||
                   moves.prefetcher == nullptr ||
                   moves.lock == nullptr || moves.param_ids == nullptr ||
                   moves.no_offload == nullptr || moves.graph_task_id == nullptr ||
                   moves.empty == nullptr || moves.cpu_device == nullptr)) {
    PyErr_SetString(PyExc_TypeError, "offload: Packer's move path takes all of index, "
                    "timeline, prefetcher, lock, param_ids, no_offload, graph_task_id, empty "
                    "and cpu_device, or none");
    return nullptr;
  }
  // What the core reads as its own types, without a Python call, must be them.
  if (!is_record_type(record_type)) {
    PyErr_Format(PyExc_TypeError, "offload: Packer's record_type must be the core's Record, "
                 "not %R", record_type);
    return nullptr;
  }
  if (any_move && !is_storage_index(moves.index)) {
    PyErr_Format(PyExc_TypeError, "offload: Packer's move path indexes storages in the "
                 "core's StorageIndex, not %s", Py_TYPE(moves.index)->tp_name);
    return nullptr;
  }
  if (any_move && !is_prefetcher(moves.prefetcher)) {
    PyErr_Format(PyExc_TypeError, "offload: Packer's move path registers payloads with the "
                 "core's Prefetcher, not %s", Py_TYPE(moves.prefetcher)->tp_name);
    return nullptr;
  }
  std::shared_ptr<SavedBytes> counted;
  try {
    counted = py::cast<std::shared_ptr<SavedBytes>>(py::handle(meter));
  } catch (py::cast_error&) {
  }
  if (!counted) {   // not a SavedBytes, or None (which pybind11 casts to an empty pointer)
    PyErr_Format(PyExc_TypeError, "offload: Packer's meter must be the core's SavedBytes, "
                 "not %s", Py_TYPE(meter)->tp_name);
    return nullptr;
  }
  PyObject* obj = type->tp_alloc(type, 0);
  if (obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<Packer*>(obj);
  self->head.vectorcall = packer_vectorcall;
  self->owner_ref = Py_NewRef(owner_ref);
  self->full = Py_NewRef(full);
  self->strided_pack = Py_NewRef(strided_pack);
  new (&self->meter) std::shared_ptr<SavedBytes>(std::move(counted));
  self->min_bytes = min_bytes;
  self->tensor_type = Py_NewRef(tensor_type);
  self->strided = Py_NewRef(strided);
  self->profiling = Py_NewRef(profiling);
  self->next_sequence_nr = Py_NewRef(next_sequence_nr);
  self->record_type = Py_NewRef(record_type);
  self->meter_obj = Py_NewRef(meter);
  self->generation = fork_generation;
  new (&self->moves) MovePath();
  if (any_move) {
    for (PyObject* field : {moves.index, moves.timeline, moves.prefetcher, moves.lock,
                            moves.param_ids, moves.no_offload, moves.graph_task_id, moves.empty,
                            moves.cpu_device})
      Py_INCREF(field);
    self->moves = moves;
  }
  return obj;
}

int packer_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<Packer*>(obj);
  Py_VISIT(self->full);
  Py_VISIT(self->strided_pack);
  Py_VISIT(self->meter_obj);
  return self->moves.visit(visit, arg);
}

int packer_clear(PyObject* obj) {
  reinterpret_cast<Packer*>(obj)->moves.clear();
  return 0;
}

void packer_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  auto* self = reinterpret_cast<Packer*>(obj);
  self->moves.clear();
  Py_CLEAR(self->meter_obj);
  self->meter.~shared_ptr();
  Py_CLEAR(self->owner_ref);
  Py_CLEAR(self->full);
  Py_CLEAR(self->strided_pack);
  Py_CLEAR(self->tensor_type);
  Py_CLEAR(self->strided);
  Py_CLEAR(self->profiling);
  Py_CLEAR(self->next_sequence_nr);
  Py_CLEAR(self->record_type);
  Py_TYPE(obj)->tp_free(obj);
}

// `__self__`: the hooks object whose pack this is (hook_stack.py finds its owner through
// it), None once it is gone.
PyObject* packer_self(PyObject* obj, void*) {
  return PyObject_CallNoArgs(reinterpret_cast<Packer*>(obj)->owner_ref);
}

// `retire()`: every later save goes to the Python path, which holds it as it is (a
// context exited on another thread leaves its entry on the entering thread's stack:
// hook_stack.py).
PyObject* packer_retire(PyObject* obj, PyObject*) {
  reinterpret_cast<Packer*>(obj)->generation = -1;
  Py_RETURN_NONE;
}

PyMethodDef packer_methods[] = {
    {"retire", packer_retire, METH_NOARGS,
     "Hand every later save to the Python path, which holds it as it is."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef packer_getset[] = {
    {const_cast<char*>("__self__"), packer_self, nullptr,
     const_cast<char*>("The hooks object whose pack this is, None once it is gone."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject packer_type = [] {
  PyTypeObject type = callable_type(
      "offload._C.Packer", sizeof(Packer),
      "Packer(owner_ref, full, strided_pack, meter, min_bytes, tensor_type, strided, "
      "profiling, next_sequence_nr, record_type, *, index, timeline, prefetcher, lock, "
      "param_ids, no_offload, graph_task_id, empty, cpu_device): the pack hook's front "
      "(hooks.py NOTE [Handles in C]; the keywords: its move path, NOTE [Move path in C]).",
      packer_new, packer_dealloc);
  type.tp_getset = packer_getset;
  type.tp_methods = packer_methods;
  tracked(type, packer_traverse, packer_clear);
  return type;
}();

}  // namespace

void bind_hook_front(py::module_& m) {
  add_type(m, "Packer", packer_type);
  m.def("after_fork_in_child", [] { ++fork_generation; },
        "In a forked child: the packers made before the fork hand every save to the Python "
        "path (hooks.py `_Forks`).");
}

}  // namespace offload::bind

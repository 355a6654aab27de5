// The unpack hook torch calls, in C: the Python class Unpacker (hooks.py NOTE [Handles in
// C]), the counterpart of hook_front.cpp's Packer. It checks a kept handle's version and does
// a kept save's part of the unpack, unpacks a MovedSave (moved_save.cpp), and hands every
// other handle to the Python hooks' unpack.
//
// Torch-independent and written against the CPython API for the reasons hook_front.cpp
// gives. Not tracked by the garbage collector, which is safe: nothing it holds (the hooks'
// unpack, their marks and lock) refers back to it (the hooks do not keep it: hooks.py
// `unpack_hook`), and autograd's references to it, one per save, are invisible to the
// collector whatever its type, so tracking it could not let a cycle be collected.
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "moved_save.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "saved_handles.hpp"
#include "saved_record.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// The unpack hook: a SmallSave or KeptSave here (version checked), everything else to
// `slow` (hooks.py's unpack). A KeptSave also marks the backward (`marks()`, the step's
// runtime.backward_marks.BackwardMarks, called again only when what it depends on may
// have changed: a new graph task, or a new `marks.epoch`) and notes its record's first
// unpack on the step's Timeline (hooks.py's `_kept_unpacked` does the same in Python). `slow`
// is a bound method: autograd holds this object with every save, and the saves keep the
// hooks alive through it, as they would hold the bound method itself.
struct Unpacker {
  Callable head;
  PyObject* slow;            // hooks.py's unpack
  PyObject* marks;           // the hooks' BackwardMarks
  PyObject* error;           // saved_handles.held_tensor_error
  PyObject* graph_task_id;   // torch._C._current_graph_task_id
  PyObject* profiling;       // torch._C._autograd._profiler_enabled
  PyObject* lock;            // the hooks' lock: a MovedSave loads under it
  bool marked;               // the backward marks were set ...
  long long last_task;       // ... for this graph task
  long long last_epoch;      // ... and this epoch of the marks
};

// The backward's marks, set again only when what they depend on may have changed.
void mark_backward(Unpacker* self) {
  const long long task = as_int(call(self->graph_task_id));
  const long long epoch = as_int(attr(self->marks, names.epoch));
  if (!self->marked || task != self->last_task || epoch != self->last_epoch) {
    call(self->marks);
    self->marked = true;
    self->last_task = task;
    self->last_epoch = epoch;
  }
}

// `record`: the core's Record (the packer exists only with the core's meter, whose ledger
// makes the core's records), or None for a weight.
void kept_unpacked(Unpacker* self, PyObject* record) {
  mark_backward(self);
  if (record != Py_None && !record_unpacked(record)) throw py::error_already_set();
}

PyObject* unpack(Unpacker* self, PyObject* packed) {
  PyTypeObject* type = Py_TYPE(packed);
  const bool small = type == &small_save_type;
  const bool moved = type == &moved_save_type;
  if ((!small && !moved && type != &kept_save_type) || profiler_on(self->profiling))
    return call_with(self->slow, py::handle(packed)).release().ptr();
  if (moved) {   // saved_handles.py `Moved.unpack`, in C (moved_save.cpp)
    mark_backward(self);
    return unpack_moved(packed, self->lock);
  }
  if (!small) kept_unpacked(self, reinterpret_cast<KeptSave*>(packed)->record);
  PyObject* tensor = tensor_if_unchanged(reinterpret_cast<HeldTensor*>(packed));
  if (tensor != Py_None) return tensor;   // or nullptr: the error is set
  Py_DECREF(tensor);
  // autograd's own message, made in Python (saved_handles.held_tensor_error).
  py::object exc = call_with(self->error, py::handle(packed));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  return nullptr;
}

PyObject* unpacker_vectorcall(PyObject* obj, PyObject* const* args, size_t nargsf,
                              PyObject* kwnames) {
  if (!one_argument("unpack", nargsf, kwnames)) return nullptr;
  return guarded([&] { return unpack(reinterpret_cast<Unpacker*>(obj), args[0]); });
}

PyObject* unpacker_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"slow",      "marks", "error", "graph_task_id",
                                   "profiling", "lock",  nullptr};
  PyObject *slow, *marks, *error, *graph_task_id, *profiling, *lock;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO", const_cast<char**>(keywords),
                                   &slow, &marks, &error, &graph_task_id, &profiling, &lock))
    return nullptr;
  PyObject* obj = type->tp_alloc(type, 0);
  if (obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<Unpacker*>(obj);
  self->head.vectorcall = unpacker_vectorcall;
  self->slow = Py_NewRef(slow);
  self->marks = Py_NewRef(marks);
  self->error = Py_NewRef(error);
  self->graph_task_id = Py_NewRef(graph_task_id);
  self->profiling = Py_NewRef(profiling);
  self->lock = Py_NewRef(lock);
  return obj;
}

void unpacker_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<Unpacker*>(obj);
  Py_CLEAR(self->slow);
  Py_CLEAR(self->marks);
  Py_CLEAR(self->error);
  Py_CLEAR(self->graph_task_id);
  Py_CLEAR(self->profiling);
  Py_CLEAR(self->lock);
  Py_TYPE(obj)->tp_free(obj);
}

PyMemberDef unpacker_members[] = {
    {const_cast<char*>("slow"), T_OBJECT, offsetof(Unpacker, slow), READONLY,
     const_cast<char*>("hooks.py's unpack, where every other handle goes.")},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject unpacker_type = [] {
  PyTypeObject type = callable_type(
      "offload._C.Unpacker", sizeof(Unpacker),
      "Unpacker(slow, marks, error, graph_task_id, profiling, lock): the unpack "
      "hook's front (hooks.py NOTE [Handles in C]).",
      unpacker_new, unpacker_dealloc);
  type.tp_members = unpacker_members;
  return type;
}();

}  // namespace

void bind_hook_unpacker(py::module_& m) {
  add_type(m, "Unpacker", unpacker_type);
}

}  // namespace offload::bind

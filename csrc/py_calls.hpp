// Calls from the hooks' C front (saved_handles.cpp, hook_front.cpp, hook_unpacker.cpp, ...)
// into Python objects: the tensor's attributes by interned name, and callables through
// vectorcall. Each raises a Python error as py::error_already_set; the types' entry points
// turn it back into a set error and a null return.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <mutex>

#include "bindings.hpp"

namespace offload::bind {

namespace py = pybind11;

// `body()`, whose errors (a Python error as py::error_already_set, a C++ one: an I/O
// error, an allocation that failed) come back as a set Python error and a null return:
// nothing C++ may leave a call from Python (bindings.hpp `set_python_error`).
template <typename Body>
PyObject* guarded(Body&& body) {
  try {
    return body();
  } catch (...) {
    set_python_error(std::current_exception());
  }
  return nullptr;
}

// Attribute names, interned once at import (the module holds them for the process).
struct Names {
  PyObject* layout;
  PyObject* untyped_storage;
  PyObject* nbytes;
  PyObject* grad_fn;
  PyObject* base;
  PyObject* is_leaf;
  PyObject* version;
  PyObject* detach;
  PyObject* output_nr;
  PyObject* name;
  PyObject* epoch;
  PyObject* closed;
  PyObject* fetch;
  PyObject* storage_offset;
  PyObject* clone;
};
extern Names names;   // set by bind_saved_handles (saved_handles.cpp)

// A name interned for the process (the module's attribute names); throws on failure.
inline PyObject* intern(const char* s) {
  PyObject* name = PyUnicode_InternFromString(s);
  if (name == nullptr) throw py::error_already_set();
  return name;
}

// A weak reference to `obj` without a callback, not tracked by the garbage collector (a new
// reference, or nullptr with an error set). It refers to nothing strongly, so it can be in
// no cycle: tracking it only makes every collection walk it (one more object per saved
// tensor, docs/benchmarks.md *Hook cost*). The collector still clears it when `obj` dies in
// a cycle: it finds weak references through their referent, not through its own list.
inline PyObject* untracked_weakref(PyObject* obj) {
  PyObject* ref = PyWeakref_NewRef(obj, nullptr);
  if (ref != nullptr && PyObject_GC_IsTracked(ref)) PyObject_GC_UnTrack(ref);
  return ref;
}

// `obj`'s attribute dict when it has one with entries (borrowed), else nullptr: never makes
// one (tensor_meta.py NOTE [Saved attributes]). Reading `__dict__` would make a dict for
// every tensor that has none; the slot is read as torch's own tensor traversal reads it. A
// tensor's attributes are always in that dict (torch makes its objects with tp_alloc, so
// they never have inline values for CPython to turn into one here).
inline PyObject* instance_attrs(PyObject* obj) {
  PyObject** slot = _PyObject_GetDictPtr(obj);
  if (slot == nullptr || *slot == nullptr || PyDict_GET_SIZE(*slot) == 0) return nullptr;
  return *slot;
}

inline py::object attr(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

inline py::object call_method(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_CallMethodNoArgs(obj, name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

inline py::object call(PyObject* fn) {
  PyObject* value = PyObject_CallNoArgs(fn);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// fn(args...) through vectorcall: no argument tuple (the hand-offs run once per save).
template <typename... Args>
py::object call_with(PyObject* fn, const Args&... args) {
  PyObject* argv[] = {py::handle(args).ptr()...};
  PyObject* value = PyObject_Vectorcall(fn, argv, sizeof...(Args), nullptr);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// Whether torch's profiler runs (`profiling` is torch._C._autograd._profiler_enabled): then
// both hooks take the Python path, which records the `offload::pack` / `unpack` ranges.
inline bool profiler_on(PyObject* profiling) {
  return call(profiling).ptr() == Py_True;
}

// A profiler range around a scope (util/ranges.py `span`): `open(span, name)` enters
// `span(name)` (call it only while torch's profiler runs: a range costs ~µs to make); the
// destructor exits it, keeping the error the scope may be leaving with.
class ProfilerRange {
 public:
  ProfilerRange() = default;
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

  void open(PyObject* span, PyObject* name) {
    static PyObject* enter = intern("__enter__");
    py::object range = call_with(span, py::handle(name));
    call_method(range.ptr(), enter);
    range_ = std::move(range);
  }

  ~ProfilerRange() {
    if (!range_) return;
    static PyObject* exit = intern("__exit__");
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* out = PyObject_CallMethodObjArgs(range_.ptr(), exit, Py_None, Py_None, Py_None,
                                               nullptr);
    if (out == nullptr) PyErr_Clear();   // a range that cannot close loses nothing
    Py_XDECREF(out);
    PyErr_Restore(type, value, traceback);
  }

 private:
  py::object range_;
};

// A Python lock (`threading.RLock`, the hooks') held for a scope: acquired on construction,
// released at its end, keeping the error the scope may be leaving with.
class PyLockHeld {
 public:
  explicit PyLockHeld(PyObject* lock) : lock_(lock) {
    static PyObject* acquire = intern("acquire");
    call_method(lock_, acquire);
  }
  PyLockHeld(const PyLockHeld&) = delete;
  PyLockHeld& operator=(const PyLockHeld&) = delete;

  ~PyLockHeld() {
    static PyObject* release = intern("release");
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* done = PyObject_CallMethodNoArgs(lock_, release);
    if (done == nullptr) PyErr_WriteUnraisable(lock_);   // never seen: an RLock we hold
    Py_XDECREF(done);
    PyErr_Restore(type, value, traceback);
  }

 private:
  PyObject* lock_;
};

// `lock` (not yet held) taken without holding up a thread that needs the GIL to let it go:
// tried first, then waited for with the GIL released.
template <typename Mutex>
void lock_releasing_gil(std::unique_lock<Mutex>& lock) {
  if (lock.try_lock()) return;
  std::exception_ptr error;
  Py_BEGIN_ALLOW_THREADS
  try {
    lock.lock();
  } catch (...) {   // std::system_error: the thread state must come back first
    error = std::current_exception();
  }
  Py_END_ALLOW_THREADS
  if (error) std::rethrow_exception(error);
}

inline int64_t as_int(const py::object& value) {
  const long long v = PyLong_AsLongLong(value.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Whether `node` (a grad_fn, or None) is the node saving its tensor right now: it was made
// last, so its sequence number is the one before the thread's next (`next_sequence_nr`,
// torch's; None where torch has none). Autograd's version error names such an output's node.
inline bool saving_node(PyObject* node, PyObject* next_sequence_nr) {
  static PyObject* sequence_nr = intern("_sequence_nr");
  return node != Py_None && next_sequence_nr != Py_None &&
         as_int(call_method(node, sequence_nr)) == as_int(call(next_sequence_nr)) - 1;
}

}  // namespace offload::bind

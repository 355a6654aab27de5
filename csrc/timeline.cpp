// runtime.timeline.Timeline in C: when each stored storage of a step was packed and first
// unpacked (offload/runtime/timeline.py has the Python one, for a process without the core).
//
// Why C: a row is added for every stored storage the step times (storing.py `Storer.store`) and
// marked at its first unpack (the core's Unpacker, records.load), so in Python each costs a
// method's frame and four array appends; here a row is four vector slots and the
// Unpacker marks it without a Python call (`timeline_unpacked`). Rows are plain numbers, so
// no Python object is made per row (the garbage collector walks none), as in timeline.py.
// Everything runs with the GIL held (the hooks, autograd's release of a save, the step's
// end), so the vectors need no lock of their own.
#include <Python.h>

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "py_type.hpp"
#include "round_trip.hpp"
#include "timeline.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct Rows {
  std::vector<long long> position;   // the storage's position among the step's stored ones
  std::vector<long long> nbytes;
  std::vector<double> pack_s;
  std::vector<double> unpack_s;      // NaN until its first unpack
};

struct Timeline {
  PyObject_HEAD
  Rows rows;   // constructed in timeline_new
};

PyObject* array_type = nullptr;   // array.array (columns() returns arrays, as timeline.py)

PyObject* timeline_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "Timeline() takes no arguments");
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);
  if (self != nullptr) new (&reinterpret_cast<Timeline*>(self)->rows) Rows();
  return self;
}

void timeline_dealloc(PyObject* self) {
  reinterpret_cast<Timeline*>(self)->rows.~Rows();
  Py_TYPE(self)->tp_free(self);
}

Rows& rows_of(PyObject* self) { return reinterpret_cast<Timeline*>(self)->rows; }

bool arguments(const char* name, Py_ssize_t nargs, Py_ssize_t count) {
  if (nargs == count) return true;
  PyErr_Format(PyExc_TypeError, "Timeline.%s takes %zd arguments (%zd given)", name, count,
               nargs);
  return false;
}

// add(position, nbytes, pack_s): a row for a storage packed at `pack_s`; returns its index.
PyObject* timeline_add(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!arguments("add", nargs, 3)) return nullptr;
  const long long position = PyLong_AsLongLong(args[0]);
  const long long nbytes = PyLong_AsLongLong(args[1]);
  const double pack_s = PyFloat_AsDouble(args[2]);
  if (PyErr_Occurred()) return nullptr;
  const Py_ssize_t index = timeline_add_row(self, position, nbytes, pack_s);
  return index < 0 ? nullptr : PyLong_FromSsize_t(index);
}

// unpacked(index, now_s): the storage's first unpack (later ones do not move it).
PyObject* timeline_unpacked_method(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!arguments("unpacked", nargs, 2)) return nullptr;
  const Py_ssize_t index = PyLong_AsSsize_t(args[0]);
  const double now_s = PyFloat_AsDouble(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (!timeline_unpacked(self, index, now_s)) return nullptr;
  Py_RETURN_NONE;
}

PyObject* seconds_or_none(double s) {
  return std::isnan(s) ? Py_NewRef(Py_None) : PyFloat_FromDouble(s);
}

// rows(): [key, nbytes, pack_s, unpack_s] per row, key = (position, nbytes), unpack_s None
// where never unpacked.
PyObject* timeline_rows(PyObject* self, PyObject*) {
  const Rows& rows = rows_of(self);
  const size_t n = rows.pack_s.size();
  auto out = py::reinterpret_steal<py::object>(PyList_New(static_cast<Py_ssize_t>(n)));
  if (!out) return nullptr;
  for (size_t i = 0; i < n; ++i) {
    PyObject* row = Py_BuildValue("[(LL)LdN]", rows.position[i], rows.nbytes[i],
                                  rows.nbytes[i], rows.pack_s[i],
                                  seconds_or_none(rows.unpack_s[i]));
    if (row == nullptr) return nullptr;
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), row);
  }
  return out.release().ptr();
}

template <typename T>
PyObject* as_array(const char* typecode, const std::vector<T>& values) {
  // The bytes are copied out first: building the call's arguments may run the garbage
  // collector, and so other threads, which may add rows. (An empty vector's data() may be
  // null: "" instead.)
  const char* data = values.empty() ? "" : reinterpret_cast<const char*>(values.data());
  PyObject* bytes =
      PyBytes_FromStringAndSize(data, static_cast<Py_ssize_t>(values.size() * sizeof(T)));
  if (bytes == nullptr) return nullptr;
  return PyObject_CallFunction(array_type, "sN", typecode, bytes);
}

// columns(): (positions, nbytes, pack_s, unpack_s), the rows as columns: arrays, and a list
// with None where never unpacked (RoundTripPlan.learn_columns; no object per row kept).
PyObject* timeline_columns(PyObject* self, PyObject*) {
  const Rows& rows = rows_of(self);
  auto unpack_s = py::reinterpret_steal<py::object>(
      PyList_New(static_cast<Py_ssize_t>(rows.unpack_s.size())));
  if (!unpack_s) return nullptr;
  for (size_t i = 0; i < rows.unpack_s.size(); ++i) {
    PyObject* s = seconds_or_none(rows.unpack_s[i]);
    if (s == nullptr) return nullptr;
    PyList_SET_ITEM(unpack_s.ptr(), static_cast<Py_ssize_t>(i), s);
  }
  PyObject* positions = as_array("q", rows.position);
  PyObject* nbytes = positions == nullptr ? nullptr : as_array("q", rows.nbytes);
  PyObject* pack_s = nbytes == nullptr ? nullptr : as_array("d", rows.pack_s);
  if (pack_s == nullptr) {
    Py_XDECREF(positions);
    Py_XDECREF(nbytes);
    return nullptr;
  }
  return Py_BuildValue("NNNN", positions, nbytes, pack_s, unpack_s.release().ptr());
}

// round_trip_keep(out_bytes_per_s, in_bytes_per_s, latency_s, safety, max_fraction): the
// keys (position, nbytes) of the rows the round-trip plan keeps next step
// (RoundTripPlan.learn_timeline; csrc/round_trip.hpp), with no Python object per row.
PyObject* timeline_round_trip_keep(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!arguments("round_trip_keep", nargs, 5)) return nullptr;
  double values[5];
  for (Py_ssize_t i = 0; i < 5; ++i) {
    values[i] = PyFloat_AsDouble(args[i]);
    if (values[i] == -1.0 && PyErr_Occurred()) return nullptr;
  }
  if (!(values[3] >= 1.0)) {   // as round_trip.py's _check_safety says it
    PyObject* shown = PyObject_Repr(args[3]);
    if (shown == nullptr) return nullptr;
    PyErr_Format(PyExc_ValueError, "safety=%U: must be >= 1 (the round trip has to fit into "
                 "the pack-to-unpack gap at least once)", shown);
    Py_DECREF(shown);
    return nullptr;
  }
  const Rows& rows = rows_of(self);
  std::vector<std::pair<long long, long long>> keys;
  try {
    for (size_t i : round_trip_keep(rows.nbytes, rows.pack_s, rows.unpack_s,
                                    LinkSpeeds{values[0], values[1], values[2]}, values[3],
                                    values[4]))
      keys.emplace_back(rows.position[i], rows.nbytes[i]);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  // The keys are copied out first: making their objects may run the collector, and so
  // other threads, which may add rows.
  auto out = py::reinterpret_steal<py::object>(PyFrozenSet_New(nullptr));
  if (!out) return nullptr;
  for (const auto& [position, nbytes] : keys) {
    auto key = py::reinterpret_steal<py::object>(Py_BuildValue("(LL)", position, nbytes));
    if (!key || PySet_Add(out.ptr(), key.ptr()) < 0) return nullptr;
  }
  return out.release().ptr();
}

Py_ssize_t timeline_len(PyObject* self) {
  return static_cast<Py_ssize_t>(rows_of(self).pack_s.size());
}

PyMethodDef timeline_methods[] = {
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(timeline_add)),
     METH_FASTCALL, "add(position, nbytes, pack_s): a row for a storage packed at pack_s; "
     "returns its index."},
    {"unpacked",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(timeline_unpacked_method)),
     METH_FASTCALL, "unpacked(index, now_s): the storage's first unpack (later ones do not "
     "move it)."},
    {"rows", timeline_rows, METH_NOARGS,
     "[key, nbytes, pack_s, unpack_s] per row; unpack_s None where never unpacked."},
    {"columns", timeline_columns, METH_NOARGS,
     "(positions, nbytes, pack_s, unpack_s): the rows as columns."},
    {"round_trip_keep",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(timeline_round_trip_keep)),
     METH_FASTCALL, "round_trip_keep(out_bytes_per_s, in_bytes_per_s, latency_s, safety, "
     "max_fraction): the keys (position, nbytes) of the rows the round-trip plan keeps."},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods timeline_as_sequence = length_only(timeline_len);

PyTypeObject timeline_type = [] {
  // Not tracked by the garbage collector: it holds no Python object.
  PyTypeObject type = plain_type("offload._C.Timeline", sizeof(Timeline),
                                 "When each stored storage of a step was packed and first "
                                 "unpacked (runtime/timeline.py).",
                                 timeline_new, timeline_dealloc);
  type.tp_methods = timeline_methods;
  type.tp_as_sequence = &timeline_as_sequence;
  return type;
}();

}  // namespace

Py_ssize_t timeline_add_row(PyObject* timeline, long long position, long long nbytes,
                            double pack_s) {
  Rows& rows = rows_of(timeline);
  const size_t index = rows.pack_s.size();
  try {   // a whole row or none: the columns stay the same length
    rows.position.push_back(position);
    rows.nbytes.push_back(nbytes);
    rows.pack_s.push_back(pack_s);
    rows.unpack_s.push_back(std::nan(""));
  } catch (const std::bad_alloc&) {
    rows.position.resize(index);
    rows.nbytes.resize(index);
    rows.pack_s.resize(index);
    rows.unpack_s.resize(index);
    PyErr_NoMemory();
    return -1;
  }
  return static_cast<Py_ssize_t>(index);
}

bool timeline_unpacked(PyObject* timeline, Py_ssize_t index, double now_s) {
  Rows& rows = rows_of(timeline);
  if (index < 0 || static_cast<size_t>(index) >= rows.unpack_s.size()) {
    PyErr_Format(PyExc_IndexError, "offload: Timeline row %zd out of range (%zu rows)", index,
                 rows.unpack_s.size());
    return false;
  }
  if (std::isnan(rows.unpack_s[index])) rows.unpack_s[index] = now_s;
  return true;
}

bool is_timeline(PyObject* obj) { return Py_TYPE(obj) == &timeline_type; }

void bind_timeline(py::module_& m) {
  py::module_ array = py::module_::import("array");
  array_type = py::object(array.attr("array")).release().ptr();   // held for the process
  add_type(m, "Timeline", timeline_type);
}

}  // namespace offload::bind

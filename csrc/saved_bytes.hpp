// A step's SavedBytes meter (offload/runtime/saved_bytes.py has the Python one): what its
// saves hold. Counted into by the core's records (saved_record.cpp) and small saves
// (saved_handles.cpp, hook_front.cpp), which reach it without a Python call; bound to Python in
// saved_handles.cpp. Everything here runs with the GIL held (the hooks, and the deaths of
// saves and records, which Python runs with it), so the counts need no lock of their own.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "perf_clock.hpp"

namespace offload::bind {

// Bytes of saved activations resident on the device during one step, and their peak: the
// step's records add and take theirs, small saves theirs. Small storages are counted once
// while any save of them lives, keyed by the address of the storage's Python object: torch
// keeps that object for as long as the storage lives, and a live save holds the storage, so
// a key is never reused while its entry exists. Also the step's records holding tier space
// (the step ends when none is left: runtime/step.py NOTE [End of step]) and when the last
// of them died.
class SavedBytes {
 public:
  void add(int64_t nbytes) {
    resident_ += nbytes;
    if (resident_ > peak_) peak_ = resident_;
  }
  void sub(int64_t nbytes) { resident_ -= nbytes; }

  void small_saved(uintptr_t key, int64_t nbytes) {
    auto [it, fresh] = small_.try_emplace(key, Small{0, nbytes});
    if (it->second.saves++ == 0) {
      counts_.storages += 1;
      counts_.saved_bytes += nbytes;
      counts_.kept_bytes += nbytes;
      add(nbytes);
    }
  }
  void small_freed(uintptr_t key) {
    auto it = small_.find(key);
    if (it == small_.end()) return;
    if (--it->second.saves == 0) {
      sub(it->second.nbytes);
      small_.erase(it);
    }
  }

  // A saved tensor packed by the C path (its storage is counted apart, once).
  void packed() { ++counts_.packed; }
  // ... and one held by a record whose payload is resident (hooks.py `_handle`).
  void offloaded() { ++counts_.offloaded; }

  // A record was made (one per stored storage): its bytes if they stay resident, and the
  // tier whose space it holds (nullptr: its bytes were kept). Throws std::bad_alloc or
  // py::error_already_set (a tier that cannot be weakly referenced) before counting
  // anything.
  void record_made(int64_t nbytes, bool resident, PyObject* tier) {
    if (tier != nullptr) stored_in(tier) += nbytes;
    if (resident) add(nbytes);
    counts_.storages += 1;
    counts_.saved_bytes += nbytes;
    if (tier == nullptr)
      counts_.kept_bytes += nbytes;
    else
      ++live_records_;
  }
  // A record died, after its payload went back to its tier (`release_lock`).
  void record_freed(int64_t nbytes, bool resident, bool holds_space) {
    if (resident) sub(nbytes);
    if (holds_space && --live_records_ == 0) idle_since_s_ = perf_counter_s();
  }
  // Held while a dying record gives its payload back (`tier.release(payload)`, Python run
  // on whatever thread autograd dropped the record): one release at a time, as a tier
  // expects. Recursive: a release that frees another record on the same thread takes it
  // again.
  std::recursive_mutex& release_lock() { return release_lock_; }

  // What was counted since the last call, for the step's Stats (Ledger.fold): (saves the
  // C path packed, of them held by resident records, storages saved (small ones and
  // records), their bytes, of those the kept bytes, [(tier, bytes stored in it)]; a tier
  // that died since is left out). Taken out only once the result is built: building it
  // may fail, or run the garbage collector and with it code that counts more.
  pybind11::tuple take_counts() {
    const Counts c = counts_;
    const std::vector<std::pair<pybind11::object, int64_t>> stored = tier_bytes_;
    pybind11::list by_tier;
    for (const auto& [ref, nbytes] : stored) {
      PyObject* tier = PyWeakref_GetObject(ref.ptr());   // borrowed; None once it died
      if (tier != Py_None) by_tier.append(pybind11::make_tuple(pybind11::handle(tier), nbytes));
    }
    pybind11::tuple out = pybind11::make_tuple(c.packed, c.offloaded, c.storages,
                                               c.saved_bytes, c.kept_bytes, by_tier);
    counts_.packed -= c.packed;
    counts_.offloaded -= c.offloaded;
    counts_.storages -= c.storages;
    counts_.saved_bytes -= c.saved_bytes;
    counts_.kept_bytes -= c.kept_bytes;
    for (const auto& [ref, nbytes] : stored) {
      for (auto it = tier_bytes_.begin(); it != tier_bytes_.end(); ++it) {
        if (it->first.ptr() != ref.ptr()) continue;
        it->second -= nbytes;
        if (it->second == 0) tier_bytes_.erase(it);
        break;
      }
    }
    return out;
  }

  int64_t resident() const { return resident_; }
  int64_t peak() const { return peak_; }
  size_t small_storages_alive() const { return small_.size(); }
  int64_t live_records() const { return live_records_; }
  // time.perf_counter() when the last record holding tier space died; None before.
  pybind11::object idle_since_s() const {
    if (std::isnan(idle_since_s_)) return pybind11::none();
    return pybind11::float_(idle_since_s_);
  }

 private:
  struct Small {
    int64_t saves;
    int64_t nbytes;
  };
  struct Counts {
    int64_t packed = 0;
    int64_t offloaded = 0;
    int64_t storages = 0;
    int64_t saved_bytes = 0;
    int64_t kept_bytes = 0;
  };
  int64_t resident_ = 0;
  int64_t peak_ = 0;
  // Bytes stored per tier since the last take, each tier by a weak reference (a meter is
  // not walked by the garbage collector: a strong one could close a cycle through the
  // step that it would never free).
  int64_t& stored_in(PyObject* tier) {
    for (auto& [ref, nbytes] : tier_bytes_)   // a step has a tier or two
      if (PyWeakref_GetObject(ref.ptr()) == tier) return nbytes;
    auto ref = pybind11::reinterpret_steal<pybind11::object>(PyWeakref_NewRef(tier, nullptr));
    if (!ref) throw pybind11::error_already_set();
    return tier_bytes_.emplace_back(std::move(ref), 0).second;
  }

  Counts counts_;
  std::vector<std::pair<pybind11::object, int64_t>> tier_bytes_;
  int64_t live_records_ = 0;
  double idle_since_s_ = std::nan("");
  std::unordered_map<uintptr_t, Small> small_;
  std::recursive_mutex release_lock_;
};

}  // namespace offload::bind

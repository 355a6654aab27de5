// A step's SavedBytes meter (offload/runtime/saved_bytes.py has the Python one): what its
// saves hold. Counted into by the core's records (saved_record.cpp) and small saves
// (saved_handles.cpp, hook_front.cpp), which reach it without a Python call; bound to Python in
// saved_handles.cpp. Everything here runs with the GIL held (the hooks, and the deaths of
// saves and records, which Python runs with it), so the counts need no lock of their own.
#pragma once

#include <pybind11/pybind11.h>

#include <time.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <unordered_map>

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
      ++new_storages_;
      new_bytes_ += nbytes;
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

  void packed() { ++packed_; }

  // A record was made: its bytes if they stay resident, and whether it holds tier space.
  void record_made(int64_t nbytes, bool resident, bool holds_space) {
    if (resident) add(nbytes);
    if (holds_space) ++live_records_;
  }
  // A record died, after its payload went back to its tier (`release_lock`).
  void record_freed(int64_t nbytes, bool resident, bool holds_space) {
    if (resident) sub(nbytes);
    if (holds_space && --live_records_ == 0) idle_since_s_ = monotonic_s();
  }
  // Held while a dying record gives its payload back (`tier.release(payload)`, Python run
  // on whatever thread autograd dropped the record): one release at a time, as a tier
  // expects. Recursive: a release that frees another record on the same thread takes it
  // again.
  std::recursive_mutex& release_lock() { return release_lock_; }

  // (saves the C path packed, storages first saved, their bytes) since the last call: the
  // step folds them into its Stats.
  pybind11::tuple take_small() {
    pybind11::tuple out = pybind11::make_tuple(packed_, new_storages_, new_bytes_);
    packed_ = new_storages_ = new_bytes_ = 0;
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
  // time.perf_counter()'s clock on Linux (CLOCK_MONOTONIC), so the step compares the two.
  static double monotonic_s() {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
  }

  struct Small {
    int64_t saves;
    int64_t nbytes;
  };
  int64_t resident_ = 0;
  int64_t peak_ = 0;
  int64_t packed_ = 0;
  int64_t new_storages_ = 0;
  int64_t new_bytes_ = 0;
  int64_t live_records_ = 0;
  double idle_since_s_ = std::nan("");
  std::unordered_map<uintptr_t, Small> small_;
  std::recursive_mutex release_lock_;
};

}  // namespace offload::bind

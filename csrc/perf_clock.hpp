// time.perf_counter()'s clock, read in C: the core's objects note times the Python side
// compares with its own (a step's timeline rows, when its last record died).
#pragma once

#include <time.h>

namespace offload::bind {

// Seconds on CLOCK_MONOTONIC: what time.perf_counter() reads on Linux.
inline double perf_counter_s() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

}  // namespace offload::bind

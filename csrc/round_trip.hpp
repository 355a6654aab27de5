// The round-trip plan's choice in C++ (offload/runtime/round_trip.py, `RoundTripPlan` and
// `_Columns`): which of a step's stored storages to keep where they are next step, because
// moving them out and back would not free memory for long enough.
//
// Why here: the step end runs it over every stored storage of the step, some nine rounds
// of two queue simulations each; in Python that was ~3 µs per saved tensor of the step's
// end (docs/benchmarks.md *Hook cost*). It reads plain numbers only, makes no Python
// object, and is torch-independent like the rest of the core. The arithmetic is the
// Python's, operation for operation and in the same order, in IEEE doubles (no fused
// multiply-add: the build compiles this file with -ffp-contract=off), so both choose the
// same rows bit for bit (tests/test_round_trip.py checks them against each other).
#pragma once

#include <cstddef>
#include <vector>

namespace offload {

// The measured speeds of a tier's path (round_trip.py `LinkSpeed`).
struct LinkSpeeds {
  double out_bytes_per_s;
  double in_bytes_per_s;
  double latency_s;
};

// The rows `RoundTripPlan` keeps, in the order it chose them: rows whose round trip does
// not fit `safety` times into its pack → unpack gap in the simulated copy queues, shortest
// gaps first, up to `max_fraction` of all rows' bytes. Row i stored `nbytes[i]`, was packed
// at `pack_s[i]` and first unpacked at `unpack_s[i]` (NaN: never). The three vectors have
// one length; `safety` >= 1 (the caller checks it, with the Python's message).
std::vector<size_t> round_trip_keep(const std::vector<long long>& nbytes,
                                    const std::vector<double>& pack_s,
                                    const std::vector<double>& unpack_s,
                                    const LinkSpeeds& link, double safety,
                                    double max_fraction);

}  // namespace offload

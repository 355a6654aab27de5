// round_trip.hpp. Each piece names the Python it mirrors (offload/runtime/round_trip.py);
// where Python's builtins decide ties (min, max, stable sorts, reverse sorts), the comments
// say which way, since the same rows must come out.
#include "round_trip.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace offload {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Python's max(a, b) / min(a, b): the first argument unless the second is strictly
// greater / smaller.
double py_max(double a, double b) { return b > a ? b : a; }
double py_min(double a, double b) { return b < a ? b : a; }

// `_Columns`: the rows with their transfer times and both queue orders sorted once.
class Columns {
 public:
  Columns(const std::vector<long long>& nbytes, const std::vector<double>& pack_s,
          const std::vector<double>& unpack_s, const LinkSpeeds& link)
      : nbytes_(nbytes), pack_s_(pack_s), unpack_s_(unpack_s), n_(nbytes.size()),
        out_s_(n_), in_s_(n_), by_pack_(n_), by_unpack_(n_) {
    for (size_t i = 0; i < n_; ++i) {
      // LinkSpeed.out_s / in_s: latency + nbytes / speed (the int converted, then divided).
      out_s_[i] = link.latency_s + static_cast<double>(nbytes_[i]) / link.out_bytes_per_s;
      in_s_[i] = link.latency_s + static_cast<double>(nbytes_[i]) / link.in_bytes_per_s;
    }
    std::iota(by_pack_.begin(), by_pack_.end(), size_t{0});
    std::stable_sort(by_pack_.begin(), by_pack_.end(),
                     [&](size_t a, size_t b) { return pack_s_[a] < pack_s_[b]; });
    // Latest unpack first, never unpacked last (its key -inf); Python's reverse sort keeps
    // equal keys in row order, as a stable sort on "greater" does.
    std::iota(by_unpack_.begin(), by_unpack_.end(), size_t{0});
    std::stable_sort(by_unpack_.begin(), by_unpack_.end(),
                     [&](size_t a, size_t b) { return unpack_key(a) > unpack_key(b); });
  }

  size_t size() const { return n_; }
  long long nbytes(size_t i) const { return nbytes_[i]; }

  // `_Columns.gap_s`.
  double gap_s(size_t i) const {
    return std::isnan(unpack_s_[i]) ? kInf : unpack_s_[i] - pack_s_[i];
  }

  // `_Columns.keep(safety, 0.0)`: the rows kept, in the order they were.
  std::vector<size_t> keep(double safety) const {
    std::vector<double> need(n_);
    for (size_t i = 0; i < n_; ++i)
      need[i] = py_max(0.0, (safety - 1.0) * (out_s_[i] + in_s_[i]));
    std::vector<char> moving(n_, 1);
    std::vector<double> out_done(n_), in_start(n_);
    std::vector<size_t> kept, failing;
    size_t left = n_;
    while (left > 0) {
      windows(moving, &out_done, &in_start);
      failing.clear();
      for (size_t i = 0; i < n_; ++i)
        if (moving[i] && in_start[i] - out_done[i] < need[i]) failing.push_back(i);
      if (failing.empty()) break;
      sort_by_gap(&failing);
      const size_t take = std::max<size_t>(1, failing.size() / 2);
      for (size_t k = 0; k < take; ++k) {
        kept.push_back(failing[k]);
        moving[failing[k]] = 0;
        --left;
      }
    }
    return kept;
  }

  // Stable, shortest gap first (Python's list.sort(key=gap_s)).
  void sort_by_gap(std::vector<size_t>* rows) const {
    std::stable_sort(rows->begin(), rows->end(),
                     [&](size_t a, size_t b) { return gap_s(a) < gap_s(b); });
  }

 private:
  double unpack_key(size_t i) const { return std::isnan(unpack_s_[i]) ? -kInf : unpack_s_[i]; }

  // `_Columns.windows`: copies out one after another in pack order; copies back as late as
  // possible, one after another, each done by its tensor's unpack.
  void windows(const std::vector<char>& moving, std::vector<double>* out_done,
               std::vector<double>* in_start) const {
    std::fill(out_done->begin(), out_done->end(), 0.0);
    std::fill(in_start->begin(), in_start->end(), kInf);
    double busy_until = -kInf;
    for (size_t i : by_pack_) {
      if (!moving[i]) continue;
      const double start = py_max(pack_s_[i], busy_until);
      busy_until = (*out_done)[i] = start + out_s_[i];
    }
    double free_from = kInf;   // the in-link is free before this time (filled backwards)
    for (size_t i : by_unpack_) {
      if (!moving[i] || std::isnan(unpack_s_[i])) continue;   // never unpacked: stays inf
      const double finish = py_min(unpack_s_[i], free_from);
      free_from = (*in_start)[i] = finish - in_s_[i];
    }
  }

  const std::vector<long long>& nbytes_;
  const std::vector<double>& pack_s_;
  const std::vector<double>& unpack_s_;
  const size_t n_;
  std::vector<double> out_s_, in_s_;
  std::vector<size_t> by_pack_, by_unpack_;
};

}  // namespace

std::vector<size_t> round_trip_keep(const std::vector<long long>& nbytes,
                                    const std::vector<double>& pack_s,
                                    const std::vector<double>& unpack_s,
                                    const LinkSpeeds& link, double safety,
                                    double max_fraction) {
  // `RoundTripPlan._choose`.
  Columns cols(nbytes, pack_s, unpack_s, link);
  if (cols.size() == 0) return {};
  long long all_bytes = 0;
  for (size_t i = 0; i < cols.size(); ++i) all_bytes += cols.nbytes(i);
  const double budget = max_fraction * static_cast<double>(all_bytes);
  // Row order, then by gap (stable): ties go to the earlier row.
  std::vector<size_t> candidates = cols.keep(safety);
  std::sort(candidates.begin(), candidates.end());
  cols.sort_by_gap(&candidates);
  std::vector<size_t> chosen;
  long long total = 0;
  for (size_t i : candidates) {
    // Python compares the int with the float exactly; a long double holds every long long
    // exactly (x86-64: 64-bit mantissa; aarch64: 113), so this does too.
    if (static_cast<long double>(total + cols.nbytes(i)) > static_cast<long double>(budget))
      continue;   // a smaller one with a longer gap may still fit
    chosen.push_back(i);
    total += cols.nbytes(i);
  }
  return chosen;
}

}  // namespace offload

// Rounding to alignment units (O_DIRECT sectors, arena granules, stripe units).
#pragma once

#include <cstdint>

namespace offload {

// Smallest multiple of `unit` that is >= n (unit > 0; need not be a power of two).
constexpr uint64_t align_up(uint64_t n, uint64_t unit) noexcept { return (n + unit - 1) / unit * unit; }

}  // namespace offload

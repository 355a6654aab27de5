// CRC-32C (Castagnoli), used to detect corruption of data parked on disk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload {

// Extends `crc` (0 to start) over `data`. Uses the SSE4.2 crc32 instruction when the CPU
// has it, a slicing-by-8 table otherwise; both give identical results.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0) noexcept;

// The table implementation alone (lets tests check the two against each other).
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t crc = 0) noexcept;

// Which implementation crc32c() uses on this CPU: "sse4.2" or "table".
const char* crc32c_backend() noexcept;

}  // namespace offload

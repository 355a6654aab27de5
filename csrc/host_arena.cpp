#include "host_arena.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <string>

#include "align.hpp"
#include "cuda_copy.hpp"
#include "error.hpp"

namespace offload {

HostMemory::HostMemory(uint64_t nbytes, bool pinned) : nbytes_(nbytes), pinned_(pinned) {
  if (pinned) {
    data_ = static_cast<char*>(cuda::host_alloc_pinned(nbytes, &device_));
    // A forked child (a DataLoader worker) must not keep these pages after the parent frees
    // them; it cannot use CUDA anyway, so it gets no mapping at all. Advice only.
    madvise(data_, align_up(nbytes, static_cast<uint64_t>(sysconf(_SC_PAGESIZE))), MADV_DONTFORK);
    return;
  }
  // Anonymous mmap: page aligned, committed lazily (an unused arena costs no RAM) and
  // returned to the OS in one call.
  void* ptr = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED)
    throw_io_error(errno, "cannot reserve " + std::to_string(nbytes) + " bytes for the host arena");
  data_ = static_cast<char*>(ptr);
  // Transparent huge pages where the kernel offers them (THP "madvise" or "always"): an
  // arena lives for many steps, and 2 MiB pages make its first touch, and the page pinning
  // of every O_DIRECT transfer into it, 512x fewer operations. Advice only: ignored when
  // THP is off.
  if (nbytes >= (2u << 20)) madvise(ptr, nbytes, MADV_HUGEPAGE);
  // A forked child gets zero pages here instead of sharing ours, so the parent's arena
  // memory goes back to the OS when the parent frees it, however long the child lives.
#ifdef MADV_WIPEONFORK
  if (madvise(ptr, nbytes, MADV_WIPEONFORK) != 0) madvise(ptr, nbytes, MADV_DONTFORK);
#else
  madvise(ptr, nbytes, MADV_DONTFORK);
#endif
}

HostMemory::~HostMemory() {
  if (data_ == nullptr) return;
  if (pinned_)
    cuda::host_free_pinned(data_, device_);
  else
    munmap(data_, nbytes_);
}

HostRegion::HostRegion(std::shared_ptr<HostArena> arena, uint64_t offset, uint64_t nbytes)
    : arena_(std::move(arena)),
      offset_(offset),
      nbytes_(nbytes),
      capacity_(arena_->allocator_.round_up(nbytes)) {}

HostRegion::~HostRegion() {
  try {
    arena_->allocator_.free(offset_, nbytes_);
  } catch (...) {
    // Unreachable by construction (each region frees exactly once); a destructor must
    // not throw.
  }
}

char* HostRegion::data() const noexcept { return arena_->memory_.data() + offset_; }

HostArena::HostArena(uint64_t capacity_bytes, bool pinned)
    : memory_(capacity_bytes, pinned), allocator_(capacity_bytes, kDefaultAlignment) {}

std::shared_ptr<HostArena> HostArena::create(uint64_t capacity_bytes,
                                             std::optional<bool> pinned) {
  if (capacity_bytes == 0)
    throw InvalidArgument("HostArena: capacity_bytes must be positive, got 0");
  const uint64_t rounded = align_up(capacity_bytes, kDefaultAlignment);
  bool pin = pinned.value_or(cuda::usable());
  if (pin && !cuda::usable())
    throw std::runtime_error("HostArena: pinned=True needs a usable CUDA device, but " +
                             cuda::unusable_reason() +
                             " (pass pinned=None to pin only when a GPU is present)");
  return std::shared_ptr<HostArena>(new HostArena(rounded, pin));
}

std::shared_ptr<HostRegion> HostArena::allocate(uint64_t nbytes) {
  std::optional<uint64_t> offset = allocator_.allocate(nbytes);
  if (!offset) return nullptr;
  try {
    return std::make_shared<HostRegion>(shared_from_this(), *offset, nbytes);
  } catch (...) {
    allocator_.free(*offset, nbytes);
    throw;
  }
}

const std::shared_ptr<HostRegion>& HostBlock::region() const {
  if (released_ || !region_) throw UseAfterClose("HostBlock was released; its memory is no longer usable");
  return region_;
}

void HostBlock::release() noexcept {
  released_ = true;
  if (!exported_) region_.reset();
}

}  // namespace offload

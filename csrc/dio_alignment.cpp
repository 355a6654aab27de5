// Kept in its own translation unit: glibc 2.36's <sys/stat.h> declares a `struct statx`
// without the direct-I/O fields, and it cannot be mixed with <linux/stat.h>, which has them.
#include <linux/fcntl.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace offload {

// Direct-I/O alignment the kernel reports for `fd`: 0 when the file does not support
// direct I/O, -1 when the kernel cannot tell (older than 6.1, or no statx).
int64_t query_dio_alignment(int fd) {
#if defined(SYS_statx) && defined(STATX_DIOALIGN)
  struct statx stx {};
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) return -1;
  if ((stx.stx_mask & STATX_DIOALIGN) == 0) return -1;
  if (stx.stx_dio_offset_align == 0) return 0;
  uint32_t align = stx.stx_dio_offset_align;
  if (stx.stx_dio_mem_align > align) align = stx.stx_dio_mem_align;
  return align;
#else
  (void)fd;
  return -1;
#endif
}

}  // namespace offload

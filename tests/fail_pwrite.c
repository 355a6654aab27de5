/* A pwrite that fails on request, loaded with LD_PRELOAD into a test's child process
 * (test_storage_errors.py): `fail_pwrites(n, err)` makes the next n writes fail with errno
 * `err`, on whichever thread issues them (the store's I/O workers). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/types.h>
#include <unistd.h>

static atomic_int failing = 0;
static atomic_int fail_errno = EIO;

void fail_pwrites(int n, int err) {
  atomic_store(&fail_errno, err);
  atomic_store(&failing, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  static ssize_t (*real)(int, const void*, size_t, off_t);
  if (!real) real = (ssize_t(*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
  int left = atomic_load(&failing);
  while (left > 0) {
    if (atomic_compare_exchange_weak(&failing, &left, left - 1)) {
      errno = atomic_load(&fail_errno);
      return -1;
    }
  }
  return real(fd, buf, n, off);
}

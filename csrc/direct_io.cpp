#include "direct_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "error.hpp"

namespace offload {

int64_t query_dio_alignment(int fd);  // dio_alignment.cpp

namespace {

std::string free_space_note(const std::string& dir) {
  struct statvfs vfs {};
  if (statvfs(dir.c_str(), &vfs) != 0) return "";
  const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return " (" + std::to_string(free_bytes) + " bytes free there)";
}

}  // namespace

FileDescriptor::~FileDescriptor() { reset(); }

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int FileDescriptor::release() noexcept { return std::exchange(fd_, -1); }

void FileDescriptor::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);  // close(2) must not be retried on EINTR (Linux frees the fd)
  fd_ = -1;
}

void validate_directory(const std::string& dir) {
  if (dir.empty()) throw_io_error(ENOENT, "NVMe directory is an empty string", dir);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    throw_io_error(err,
                   err == ENOENT ? "NVMe directory does not exist"
                                 : "cannot access NVMe directory",
                   dir);
  }
  if (!S_ISDIR(st.st_mode)) throw_io_error(ENOTDIR, "NVMe path is not a directory", dir);
  // access() reports EROFS even for root, who bypasses permission bits.
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw_io_error(errno, "NVMe directory is not writable", dir);
}

SlabFile::SlabFile(const std::string& dir, bool want_direct, std::vector<LogNote>* notes)
    : dir_(dir), label_(dir) {
  validate_directory(dir);  // the only check: NvmeStore builds every SlabFile before reserving
  open_anonymous(notes);
  if (want_direct) enable_direct(notes);
}

void SlabFile::open_anonymous(std::vector<LogNote>* notes) {
  // O_TMPFILE: the file never has a name, so nothing can be left behind, even on SIGKILL.
  int fd = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) {
    fd_ = FileDescriptor(fd);
    return;
  }
  const int err = errno;
  if (err != EOPNOTSUPP && err != EISDIR && err != EINVAL)
    throw_io_error(err, "cannot create the slab file in NVMe directory", dir_);
  // Filesystem without O_TMPFILE: create exclusively with mode 0600 and unlink at once;
  // the window in which a crash leaves a file is a few microseconds.
  std::string path = dir_ + "/.offload-slab-XXXXXX";
  fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) throw_io_error(errno, "cannot create the slab file in NVMe directory", dir_);
  fd_ = FileDescriptor(fd);
  if (::unlink(path.c_str()) != 0) {
    const int unlink_err = errno;
    fd_.reset();
    throw_io_error(unlink_err, "cannot unlink the new slab file", path);
  }
  notes->push_back({10, "O_TMPFILE is not supported in '" + dir_ +
                            "'; using a mode-0600 file unlinked right after creation"});
}

void SlabFile::reserve(uint64_t nbytes, std::vector<LogNote>* notes) {
  nbytes_ = nbytes;
  int rc;
  do {
    rc = ::fallocate(fd_.get(), 0, 0, static_cast<off_t>(nbytes_));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  const int err = errno;
  if (err != EOPNOTSUPP && err != ENOSYS)
    throw_io_error(err,
                   "cannot reserve " + std::to_string(nbytes_) + " bytes for the NVMe slab" +
                       free_space_note(dir_) + "; lower the NVMe capacity or free space on that disk",
                   dir_);
  notes->push_back({30, "fallocate is not supported in '" + dir_ +
                            "', so the nvme tier's space is not reserved up front: a disk that "
                            "fills up while it writes fails that step with ENOSPC (keep more "
                            "free space there than OFFLOAD_NVME_BYTES, or use a file system "
                            "with fallocate: ext4, xfs)"});
  if (::ftruncate(fd_.get(), static_cast<off_t>(nbytes_)) != 0)
    throw_io_error(errno, "cannot size the NVMe slab file", dir_, 0,
                   static_cast<int64_t>(nbytes_));
}

void SlabFile::enable_direct(std::vector<LogNote>* notes) {
  auto refuse = [&](int err, const std::string& why) {
    notes->push_back({30, "O_DIRECT is not supported in '" + dir_ + "' (" + why + ": " +
                              std::strerror(err) + "); using buffered I/O there"});
  };
  const int64_t reported = query_dio_alignment(fd_.get());
  if (reported == 0) return refuse(EINVAL, "statx reports no direct I/O support");
  alignment_ = std::max<uint64_t>(4096, reported > 0 ? static_cast<uint64_t>(reported) : 0);

  const int flags = ::fcntl(fd_.get(), F_GETFL);
  if (flags < 0) throw_io_error(errno, "fcntl(F_GETFL) failed on the slab file", dir_);
  if (::fcntl(fd_.get(), F_SETFL, flags | O_DIRECT) != 0) return refuse(errno, "fcntl");

  // Some filesystems accept the flag and refuse the I/O; find out now, not mid-training.
  AlignedBuffer probe(alignment_, alignment_);
  std::memset(probe.data(), 0, alignment_);
  ssize_t n;
  do {
    n = ::pwrite(fd_.get(), probe.data(), alignment_, 0);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(alignment_)) {
    direct_ = true;
    return;
  }
  const int err = n < 0 ? errno : EIO;
  ::fcntl(fd_.get(), F_SETFL, flags);
  if (err != EINVAL) throw_io_error(err, "test write to the slab file failed", dir_, 0, alignment_);
  refuse(err, "test write");
}

// errno for an O_DIRECT transfer that stopped early at an offset it cannot resume from.
// The kernel ends a direct write early when the filesystem runs out of blocks (the next
// call would report ENOSPC), and a read early at end of file; a full disk is told apart
// from a device that gave up by the free space left.
static int short_direct_errno(bool write, const std::string& dir, uint64_t remaining) {
  if (!write) return EIO;
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0 &&
      static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < remaining)
    return ENOSPC;
  return EIO;
}

void SlabFile::transfer_full(bool write, char* p, size_t nbytes, uint64_t offset) const {
  size_t done = 0;
  while (done < nbytes) {
    const off_t at = static_cast<off_t>(offset + done);
    const ssize_t n = write ? ::pwrite(fd_.get(), p + done, nbytes - done, at)
                            : ::pread(fd_.get(), p + done, nbytes - done, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io_error(errno,
                     !write             ? "read from the NVMe slab file failed"
                     : errno == ENOSPC ? "write to the NVMe slab file failed: the disk is "
                                         "full (its file system reserves no space up front; "
                                         "free space there or lower OFFLOAD_NVME_BYTES)"
                                       : "write to the NVMe slab file failed",
                     label_, static_cast<int64_t>(offset + done), static_cast<int64_t>(nbytes - done));
    }
    if (n == 0)  // the slab was sized up front, so EOF means it was truncated under us
      throw_io_error(EIO,
                     write ? "write to the NVMe slab file made no progress"
                           : "unexpected end of the NVMe slab file",
                     label_, static_cast<int64_t>(offset + done), static_cast<int64_t>(nbytes - done));
    done += static_cast<size_t>(n);
    // A short transfer is resumed where it stopped, which O_DIRECT allows only at an
    // aligned offset: resuming elsewhere fails with EINVAL and hides the real cause.
    if (direct_ && done < nbytes && done % alignment_ != 0) {
      const uint64_t remaining = nbytes - done;
      const int err = short_direct_errno(write, dir_, remaining);
      throw_io_error(err,
                     std::string("short O_DIRECT ") + (write ? "write" : "read") + ": " +
                         std::to_string(done) + " of " + std::to_string(nbytes) +
                         " bytes moved, ending at an offset that is not a multiple of the " +
                         std::to_string(alignment_) + "-byte alignment" +
                         (err == ENOSPC ? "; the disk is full" + free_space_note(dir_) +
                                              " (free space on that disk or lower the NVMe capacity)"
                                        : "; the device or filesystem ended the transfer early"),
                     label_, static_cast<int64_t>(offset + done), static_cast<int64_t>(remaining));
    }
  }
}

void SlabFile::pwrite_full(const void* buf, size_t nbytes, uint64_t offset) const {
  // pwrite never writes through the pointer; the cast lets one loop serve both directions.
  transfer_full(true, const_cast<char*>(static_cast<const char*>(buf)), nbytes, offset);
}

void SlabFile::pread_full(void* buf, size_t nbytes, uint64_t offset) const {
  transfer_full(false, static_cast<char*>(buf), nbytes, offset);
}

AlignedBuffer::AlignedBuffer(size_t nbytes, size_t alignment) : nbytes_(nbytes) {
  void* ptr = nullptr;
  const int rc = ::posix_memalign(&ptr, alignment, std::max<size_t>(nbytes, 1));
  if (rc != 0) throw std::bad_alloc();
  data_ = static_cast<char*>(ptr);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), nbytes_(std::exchange(other.nbytes_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    nbytes_ = std::exchange(other.nbytes_, 0);
  }
  return *this;
}

}  // namespace offload

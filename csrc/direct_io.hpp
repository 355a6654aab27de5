// Slab files: one private, preallocated file per NVMe directory, read and written with
// O_DIRECT where the filesystem allows it. Every transfer is checked: short transfers are
// resumed (with O_DIRECT only from an aligned offset, else reported as ENOSPC/EIO), EINTR
// is retried, failures raise IoError with errno, path, offset and size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload {

// A message for Python's logging, gathered while the GIL is released and emitted later.
struct LogNote {
  int level;  // Python logging levels: 10 debug, 20 info, 30 warning
  std::string message;
};

// RAII file descriptor.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor();
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const noexcept { return fd_; }
  int release() noexcept;
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// Checks that `dir` exists, is a directory and can hold files; throws IoError (ENOENT,
// ENOTDIR, EACCES, EROFS...) naming the path otherwise.
void validate_directory(const std::string& dir);

class SlabFile {
 public:
  // Creates an anonymous file in `dir` (O_TMPFILE, else a mode-0600 file unlinked right
  // after creation) and switches it to O_DIRECT when `want_direct` and the filesystem
  // accepts it (a test write proves it).
  SlabFile(const std::string& dir, bool want_direct, std::vector<LogNote>* notes);

  // Reserves `nbytes` on disk (fallocate), so a full disk shows up here as ENOSPC.
  void reserve(uint64_t nbytes, std::vector<LogNote>* notes);
  SlabFile(const SlabFile&) = delete;
  SlabFile& operator=(const SlabFile&) = delete;

  const std::string& dir() const noexcept { return dir_; }
  // What error messages call the file (it has no name on disk).
  const std::string& label() const noexcept { return label_; }
  bool direct() const noexcept { return direct_; }
  // File offsets, lengths and buffer addresses must be multiples of this for O_DIRECT.
  uint64_t alignment() const noexcept { return alignment_; }
  uint64_t nbytes() const noexcept { return nbytes_; }
  int fd() const noexcept { return fd_.get(); }
  void close() noexcept { fd_.reset(); }

  void pwrite_full(const void* buf, size_t nbytes, uint64_t offset) const;
  void pread_full(void* buf, size_t nbytes, uint64_t offset) const;

 private:
  void open_anonymous(std::vector<LogNote>* notes);
  // pwrite/pread until `nbytes` moved: EINTR retried, short transfers resumed (on a direct
  // slab only at aligned offsets), every failure an IoError with offset and size.
  void transfer_full(bool write, char* p, size_t nbytes, uint64_t offset) const;
  void enable_direct(std::vector<LogNote>* notes);

  std::string dir_;
  std::string label_;
  uint64_t nbytes_ = 0;
  FileDescriptor fd_;
  bool direct_ = false;
  uint64_t alignment_ = 4096;
};

// Owns a block of memory aligned for O_DIRECT (bounce buffers).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(size_t nbytes, size_t alignment);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const noexcept { return data_; }
  size_t nbytes() const noexcept { return nbytes_; }

 private:
  char* data_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace offload

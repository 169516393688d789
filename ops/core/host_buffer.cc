#include "host_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>

namespace kerasdist::core {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}

void AdviseHugePages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  uintptr_t begin =
      (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin)
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

HostBuffer::~HostBuffer() { std::free(data_); }

char* HostBuffer::Reserve(int64_t bytes) {
  if (bytes <= size_) return data_;
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
  size_t rounded =
      (static_cast<size_t>(bytes) + kHugePage - 1) & ~(kHugePage - 1);
  void* p = nullptr;
  if (posix_memalign(&p, kHugePage, rounded) != 0) throw std::bad_alloc();
  AdviseHugePages(p, rounded);  // before the first touch
  data_ = static_cast<char*>(p);
  size_ = static_cast<int64_t>(rounded);
  return data_;
}

}  // namespace kerasdist::core

#include "shm_allreduce.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "../scale.h"

namespace kerasdist::core {

namespace {

constexpr int64_t kRound = int64_t{2} << 20;

// `job`: the pid of the communicator's rank 0 and which of that process's
// communicators (its job's, then each process set's) it is, so that the
// segments of two runtimes of one process never share a name.
std::string SegmentName(const long job[2], int generation, int rank) {
  char name[96];
  std::snprintf(name, sizeof(name), "/kerasdist.%ld.%ld.%d.%d", job[0], job[1],
                generation, rank);
  return name;
}

std::atomic<long> g_instances{0};

// Maps `name` (created, with `bytes` reserved, when `create`); null on failure.
char* MapSegment(const std::string& name, int64_t bytes, bool create) {
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  // posix_fallocate, not ftruncate alone: a full /dev/shm must fail here,
  // not with SIGBUS on first touch.
  if (create && posix_fallocate(fd, 0, bytes) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return nullptr;
  }
  return static_cast<char*>(p);
}

}  // namespace

Status ShmAllreduce::Create(Communicator* comm, Communicator* node,
                            bool enabled, int64_t min_bytes,
                            std::unique_ptr<ShmAllreduce>* out) {
  out->reset();
  bool all = false;
  KD_RETURN_IF_ERROR(AgreeAll(*comm, enabled, &all));
  if (!all || node == nullptr) return Status::OK();
  std::unique_ptr<ShmAllreduce> s(new ShmAllreduce());
  s->comm_ = node;
  s->rank_ = node->rank();
  s->size_ = node->size();
  // The ranks agree on the largest minimum given.
  KD_RETURN_IF_ERROR(AgreeLargest(*node, min_bytes, &s->min_bytes_));
  *out = std::move(s);
  return Status::OK();
}

ShmAllreduce::~ShmAllreduce() { Unmap(); }

bool ShmAllreduce::Supports(DataType dt, ReduceOp op) {
  if (op == ReduceOp::kAverage || op == ReduceOp::kAdasum) return false;
  return dt != DataType::kUInt8 && dt != DataType::kBool;
}

void ShmAllreduce::Unmap() {
  for (char* p : slots_) {
    if (p != nullptr) munmap(p, capacity_);
  }
  slots_.clear();
  capacity_ = 0;
}

Status ShmAllreduce::Grow(int64_t bytes, bool* ok) {
  *ok = false;
  if (used_) {
    // Nobody may still read the old slots.
    KD_RETURN_IF_ERROR(comm_->Barrier());
    used_ = false;
  }
  Unmap();
  const int64_t cap = (bytes + kRound - 1) / kRound * kRound;
  if (instance_ < 0) instance_ = g_instances++;
  long job[2] = {static_cast<long>(getpid()), instance_};
  KD_RETURN_IF_ERROR(comm_->Broadcast(job, sizeof(job), 0));
  ++generation_;
  const std::string mine = SegmentName(job, generation_, rank_);
  shm_unlink(mine.c_str());  // a leftover of a killed job with a reused pid
  char* own = MapSegment(mine, cap, true);
  bool good = own != nullptr, all = false;
  KD_RETURN_IF_ERROR(AgreeAll(*comm_, good, &all));
  std::vector<char*> slots(size_, nullptr);
  slots[rank_] = own;
  if (all) {
    for (int k = 0; k < size_; ++k) {
      if (k != rank_) {
        slots[k] = MapSegment(SegmentName(job, generation_, k), cap, false);
        if (slots[k] == nullptr) good = false;
      }
    }
    KD_RETURN_IF_ERROR(AgreeAll(*comm_, good, &all));
  }
  // Everyone has tried to map every segment: the names can go.
  if (own != nullptr) shm_unlink(mine.c_str());
  capacity_ = cap;
  slots_ = std::move(slots);
  if (!all) {
    Unmap();
    return Status::OK();
  }
  *ok = true;
  return Status::OK();
}

Status ShmAllreduce::Begin(int64_t bytes, char** slot) {
  *slot = nullptr;
  if (bytes <= 0 || bytes >= refused_) return Status::OK();
  if (bytes > capacity_) {
    bool ok = false;
    KD_RETURN_IF_ERROR(Grow(bytes, &ok));
    if (!ok) {
      refused_ = std::min(refused_, bytes);
      return Status::OK();
    }
  } else if (used_) {
    // Every rank has finished reading the previous result.
    KD_RETURN_IF_ERROR(comm_->Barrier());
  }
  used_ = true;
  *slot = slots_[rank_];
  return Status::OK();
}

Status ShmAllreduce::Publish() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  KD_RETURN_IF_ERROR(comm_->Barrier());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return Status::OK();
}

void ShmAllreduce::ReduceInto(int64_t first, int64_t n, DataType dt,
                              ReduceOp op, const void* own, void* dst,
                              double factor, int64_t divisor) const {
  const int64_t off = first * DataTypeSize(dt);
  auto src = [&](int k) -> const void* {
    return k == rank_ && own != nullptr ? own : slots_[k] + off;
  };
  if (size_ == 1) {
    ScaleCopy(dst, src(0), n, dt, factor, divisor);
    return;
  }
  // Slot 0 (op) slot 1 (op) ... slot size-1, the last step scaled: the
  // same order, so the same bits, whichever rank reduces.
  const void* acc = src(0);
  for (int k = 1; k + 1 < size_; ++k) {
    Combine(dst, acc, src(k), n, dt, op);
    acc = dst;
  }
  CombineScaled(dst, acc, src(size_ - 1), n, dt, op, factor, divisor);
}

Status ShmAllreduce::Reduce(int64_t count, DataType dt, ReduceOp op) {
  esize_ = DataTypeSize(dt);
  op_ = op;
  if (size_ == 2) {
    // Two ranks: each sums both slots straight into its outputs in CopyOut
    // (one pass less than reduce-in-place, then copy out, and one barrier).
    return Publish();
  }
  // Pieces start on 64-byte boundaries (no two ranks write one cache line).
  const int64_t grain = std::max<int64_t>(1, 64 / esize_);
  bounds_.assign(size_ + 1, count);
  for (int k = 0; k < size_; ++k) {
    int64_t b = count * k / size_;
    bounds_[k] = b - b % grain;
  }
  KD_RETURN_IF_ERROR(Publish());
  const int64_t first = bounds_[rank_], n = bounds_[rank_ + 1] - first;
  char* mine = slots_[rank_] + first * esize_;
  for (int k = 0; k < size_; ++k) {
    if (k != rank_ && n > 0)
      Combine(mine, mine, slots_[k] + first * esize_, n, dt, op);
  }
  return Publish();
}

void ShmAllreduce::CopyOut(int64_t first, int64_t n, DataType dt, void* dst,
                           double factor, int64_t divisor) const {
  char* out = static_cast<char*>(dst);
  if (size_ == 2) {
    // Slot 0 (op) slot 1 on both ranks, so both get the same bits; scaled
    // in the same pass.
    CombineScaled(out, slots_[0] + first * esize_, slots_[1] + first * esize_,
                  n, dt, op_, factor, divisor);
    return;
  }
  for (int k = 0; k < size_; ++k) {
    const int64_t lo = std::max(first, bounds_[k]);
    const int64_t hi = std::min(first + n, bounds_[k + 1]);
    if (lo < hi) {
      ScaleCopy(out + (lo - first) * esize_, slots_[k] + lo * esize_, hi - lo,
                dt, factor, divisor);
    }
  }
}

}  // namespace kerasdist::core

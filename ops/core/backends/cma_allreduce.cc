#include "cma_allreduce.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "../scale.h"

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

namespace kerasdist::core {

namespace {

// Bytes reduced at a time: two such buffers stay in a core's L2.
constexpr int64_t kChunkBytes = 256 << 10;
constexpr int kMaxIov = IOV_MAX < 1024 ? IOV_MAX : 1024;

// Reads remote[i] into local[i] for all i (lengths pairwise equal), or with
// `write` writes local[i] to remote[i].
Status Transfer(pid_t pid, const std::vector<iovec>& local,
                const std::vector<iovec>& remote, bool write = false) {
  for (size_t first = 0; first < local.size(); first += kMaxIov) {
    const size_t m = std::min<size_t>(kMaxIov, local.size() - first);
    ssize_t want = 0;
    for (size_t i = first; i < first + m; ++i) want += local[i].iov_len;
    const ssize_t got = write ? process_vm_writev(pid, local.data() + first, m,
                                                  remote.data() + first, m, 0)
                              : process_vm_readv(pid, local.data() + first, m,
                                                 remote.data() + first, m, 0);
    if (got != want) {
      const int err = got < 0 ? errno : 0;
      return Status::Internal(
          std::string(
              write
                  ? "writing into another rank's tensors (process_vm_writev to"
                  : "reading another rank's tensors (process_vm_readv from") +
          " pid " + std::to_string(pid) + ") failed: " +
          (got < 0 ? std::string(std::strerror(err))
                   : std::to_string(got) + " of " + std::to_string(want) +
                         " bytes") +
          "; set KERASDIST_CMA_ALLREDUCE=0 to use shared-memory slots "
          "instead.");
    }
  }
  return Status::OK();
}

}  // namespace

Status CmaAllreduce::Create(Communicator* comm, Communicator* node,
                            bool enabled, int64_t min_tensor_bytes,
                            std::unique_ptr<CmaAllreduce>* out) {
  out->reset();
  bool all = false;
  KD_RETURN_IF_ERROR(AgreeAll(*comm, enabled, &all));
  if (!all || node == nullptr) return Status::OK();
  std::unique_ptr<CmaAllreduce> c(new CmaAllreduce());
  c->comm_ = node;
  c->rank_ = node->rank();
  c->size_ = node->size();
  const int size = c->size_;
  // Under Yama's ptrace_scope=1 only ancestors may read a process; the
  // ranks are siblings. (EINVAL without Yama: nothing to allow.)
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  const pid_t pid = getpid();
  c->pids_.resize(size);
  KD_RETURN_IF_ERROR(node->Allgather(&pid, c->pids_.data(), sizeof(pid)));
  // Probe: read every other rank's word and write its mailbox (two ranks
  // write results into each other's outputs). Both stay alive until the
  // second agreement below, which no rank leaves before all have written;
  // the first one ends the writes before the mailboxes are checked.
  constexpr uint64_t kMagic = 0x6b64636d61000000ull;
  const uint64_t probe = kMagic + c->rank_;
  volatile uint64_t mailbox = 0;
  const uint64_t where[2] = {reinterpret_cast<uintptr_t>(&probe),
                             reinterpret_cast<uintptr_t>(&mailbox)};
  std::vector<uint64_t> wheres(2 * size);
  KD_RETURN_IF_ERROR(node->Allgather(where, wheres.data(), sizeof(where)));
  bool good = true;
  for (int k = 0; k < size && good; ++k) {
    if (k == c->rank_) continue;
    uint64_t seen = 0;
    iovec l{&seen, sizeof(seen)};
    iovec r{reinterpret_cast<void*>(wheres[2 * k]), sizeof(seen)};
    const uint64_t mark = kMagic;
    iovec wl{const_cast<uint64_t*>(&mark), sizeof(mark)};
    iovec wr{reinterpret_cast<void*>(wheres[2 * k + 1]), sizeof(mark)};
    good = process_vm_readv(c->pids_[k], &l, 1, &r, 1, 0) ==
               static_cast<ssize_t>(sizeof(seen)) &&
           seen == kMagic + k &&
           process_vm_writev(c->pids_[k], &wl, 1, &wr, 1, 0) ==
               static_cast<ssize_t>(sizeof(mark));
  }
  KD_RETURN_IF_ERROR(AgreeAll(*node, good, &all));
  good = all && (size == 1 || mailbox == kMagic);
  KD_RETURN_IF_ERROR(AgreeAll(*node, good, &all));
  if (!all) return Status::OK();
  KD_RETURN_IF_ERROR(
      AgreeLargest(*node, min_tensor_bytes, &c->min_tensor_bytes_));
  *out = std::move(c);
  return Status::OK();
}

template <typename F>
void CmaAllreduce::ForEachPiece(int64_t lo, int64_t hi, F&& f) const {
  const size_t nseg = starts_.size() - 1;
  size_t s = std::upper_bound(starts_.begin(), starts_.end(), lo) -
             starts_.begin() - 1;
  for (; s < nseg && starts_[s] < hi; ++s) {
    const int64_t a = std::max(lo, starts_[s]),
                  b = std::min(hi, starts_[s + 1]);
    if (b > a) f(s, a, b);
  }
}

Status CmaAllreduce::Copy(int k, bool outputs, int64_t lo, int64_t hi,
                          char* dst, bool write) {
  const size_t nseg = starts_.size() - 1;
  local_iov_.clear();
  remote_iov_.clear();
  ForEachPiece(lo, hi, [&](size_t s, int64_t a, int64_t b) {
    const size_t bytes = (b - a) * esize_;
    const int64_t skip = (a - starts_[s]) * esize_;
    char* peer =
        reinterpret_cast<char*>(addrs_[(k * nseg + s) * 2 + (outputs ? 1 : 0)]);
    char* here =
        dst != nullptr
            ? dst + (a - lo) * esize_
            : reinterpret_cast<char*>(addrs_[(rank_ * nseg + s) * 2 + 1]) +
                  skip;
    if (k == rank_) {
      if (write) {
        std::memcpy(peer + skip, here, bytes);
      } else {
        std::memcpy(here, peer + skip, bytes);
      }
      return;
    }
    local_iov_.push_back({here, bytes});
    remote_iov_.push_back({peer + skip, bytes});
  });
  if (local_iov_.empty()) return Status::OK();
  return Transfer(pids_[k], local_iov_, remote_iov_, write);
}

Status CmaAllreduce::Allreduce(const std::vector<Segment>& segs, DataType dt,
                               ReduceOp op, double factor, int64_t divisor,
                               TimePoint* mark1, TimePoint* mark2) {
  const size_t nseg = segs.size();
  esize_ = DataTypeSize(dt);
  starts_.assign(nseg + 1, 0);
  std::vector<uint64_t>& mine = mine_;
  mine.resize(2 * nseg);
  for (size_t s = 0; s < nseg; ++s) {
    starts_[s + 1] = starts_[s] + segs[s].count;
    mine[2 * s] = reinterpret_cast<uintptr_t>(segs[s].in);
    mine[2 * s + 1] = reinterpret_cast<uintptr_t>(segs[s].out);
  }
  const int64_t total = starts_[nseg];
  addrs_.resize(2 * nseg * size_);
  KD_RETURN_IF_ERROR(comm_->Allgather(mine.data(), addrs_.data(),
                                      2 * nseg * sizeof(uint64_t)));
  *mark1 = std::chrono::steady_clock::now();

  // Pieces start on 64-byte boundaries (no two ranks write one cache line).
  const int64_t grain = std::max<int64_t>(1, 64 / esize_);
  std::vector<int64_t> bounds(size_ + 1, total);
  for (int k = 0; k < size_; ++k) {
    const int64_t b = total * k / size_;
    bounds[k] = b - b % grain;
  }
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / esize_);
  acc_.resize(chunk * esize_);
  tmp_.resize(chunk * esize_);
  char* acc = acc_.data();
  char* tmp = tmp_.data();
  // A failed read still takes part in both barriers, and the ranks agree on
  // the outcome at the end: one rank's failure must not leave the others
  // waiting in a barrier.
  Status failed;
  const int64_t lo = bounds[rank_], hi = bounds[rank_ + 1];
  // Two ranks: this rank's own input is read where it lies, only the peer's
  // is copied (into cache-sized `tmp`), and the sum goes straight to the
  // outputs: two passes over the chunk fewer than the general loop below.
  // The operands keep rank order, as there. While the chunk's result is
  // still in cache it is also written into the peer's outputs, so step 3
  // (reading the peer's piece back from memory) and its barrier fall away:
  // the final agreement below is the only wait. The peer writes only our
  // outputs in its own piece, which we neither read nor write.
  for (int64_t a = lo; size_ == 2 && a < hi && failed.ok(); a += chunk) {
    const int64_t b = std::min(hi, a + chunk);
    failed = Copy(1 - rank_, false, a, b, tmp);
    if (!failed.ok()) break;
    ForEachPiece(a, b, [&](size_t s, int64_t x, int64_t y) {
      const int64_t skip = (x - starts_[s]) * esize_;
      const char* mine_in = static_cast<const char*>(segs[s].in) + skip;
      const char* theirs = tmp + (x - a) * esize_;
      char* out = static_cast<char*>(segs[s].out) + skip;
      CombineScaled(out, rank_ == 0 ? mine_in : theirs,
                    rank_ == 0 ? theirs : mine_in, y - x, dt, op, factor,
                    divisor);
    });
    failed = Copy(1 - rank_, true, a, b, nullptr, /*write=*/true);
  }
  for (int64_t a = lo; size_ != 2 && a < hi && failed.ok(); a += chunk) {
    const int64_t b = std::min(hi, a + chunk), m = b - a;
    // acc = in_0 (op) in_1 (op) ... in the same order on every rank.
    failed = Copy(0, false, a, b, acc);
    for (int k = 1; k < size_ && failed.ok(); ++k) {
      failed = Copy(k, false, a, b, tmp);
      Combine(acc, acc, tmp, m, dt, op);
    }
    // Scaled into this rank's outputs.
    ForEachPiece(a, b, [&](size_t s, int64_t x, int64_t y) {
      ScaleCopy(static_cast<char*>(segs[s].out) + (x - starts_[s]) * esize_,
                acc + (x - a) * esize_, y - x, dt, factor, divisor);
    });
  }
  if (size_ != 2) {
    KD_RETURN_IF_ERROR(comm_->Barrier());
  }
  *mark2 = std::chrono::steady_clock::now();
  for (int k = 0; size_ != 2 && k < size_ && failed.ok(); ++k) {
    if (k != rank_ && bounds[k] < bounds[k + 1]) {
      failed = Copy(k, true, bounds[k], bounds[k + 1], nullptr);
    }
  }
  // Nobody reads or writes this rank's memory after this.
  bool all_ok = false;
  KD_RETURN_IF_ERROR(AgreeAll(*comm_, failed.ok(), &all_ok));
  if (!failed.ok()) return failed;
  if (!all_ok) {
    return Status::Internal(
        "another rank could not read this rank's tensors (process_vm_readv); "
        "set KERASDIST_CMA_ALLREDUCE=0 to use shared-memory slots instead.");
  }
  return Status::OK();
}

}  // namespace kerasdist::core

#include "local_communicator.h"

#include <chrono>
#include <cstring>

#include "../scale.h"

namespace kerasdist::core {

namespace {

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

int64_t Sum(const std::vector<int64_t>& v, size_t end) {
  int64_t n = 0;
  for (size_t i = 0; i < end && i < v.size(); ++i) n += v[i];
  return n;
}

}  // namespace

LocalGroup::LocalGroup(int size, double timeout_s)
    : size_(size),
      timeout_s_(timeout_s),
      slots_(size),
      here_(size, false),
      mail_(size * size) {}

Status LocalGroup::BrokenLocked() const {
  return Status::Aborted("local group of " + std::to_string(size_) +
                         " ranks: " + broken_);
}

Status LocalGroup::Arrive(int rank, const char* what) {
  std::unique_lock<std::mutex> l(mu_);
  if (!broken_.empty()) return BrokenLocked();
  const uint64_t gen = generation_;
  here_[rank] = true;
  if (++arrived_ == size_) {
    arrived_ = 0;
    here_.assign(size_, false);
    ++generation_;
    cv_.notify_all();
    return Status::OK();
  }
  cv_.wait_for(l, std::chrono::duration<double>(timeout_s_),
               [&] { return generation_ != gen || !broken_.empty(); });
  // A barrier that completed counts even if a rank left just after.
  if (generation_ != gen) return Status::OK();
  if (broken_.empty()) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!here_[r]) missing.push_back(r);
    }
    broken_ = "rank(s) " + RankList(missing) + " did not reach " + what +
              " within " + std::to_string(timeout_s_) +
              " s (stuck, or they skipped the collective).";
    cv_.notify_all();
  }
  return BrokenLocked();
}

void LocalGroup::Leave(int rank, const std::string& why) {
  std::lock_guard<std::mutex> l(mu_);
  if (broken_.empty())
    broken_ = "rank " + std::to_string(rank) + " left the group (" + why + ").";
  cv_.notify_all();
}

template <typename Done>
bool LocalGroup::WaitLocked(std::unique_lock<std::mutex>& l, Done done) {
  return cv_.wait_for(l, std::chrono::duration<double>(timeout_s_),
                      [&] { return done() || !broken_.empty(); });
}

Status LocalGroup::Exchange(int rank, const void* send, int64_t send_bytes,
                            int dest, void* recv, int64_t recv_bytes,
                            int source) {
  std::unique_lock<std::mutex> l(mu_);
  if (!broken_.empty()) return BrokenLocked();
  const std::string what = "sendrecv of rank " + std::to_string(rank) +
                           " (to " + std::to_string(dest) + ", from " +
                           std::to_string(source) + ")";
  auto fail = [&](const std::string& why) {
    if (broken_.empty()) broken_ = what + ": " + why;
    cv_.notify_all();
    return BrokenLocked();
  };
  for (int peer : {dest, source}) {
    if (peer < 0 || peer >= size_ || peer == rank)
      return fail("no peer " + std::to_string(peer) + ".");
  }
  Mail& out = mail_[rank * size_ + dest];
  Mail& in = mail_[source * size_ + rank];
  out = Mail{send, send_bytes, true, false};
  cv_.notify_all();
  if (!WaitLocked(l, [&] { return in.posted; }) && broken_.empty()) {
    return fail("rank " + std::to_string(source) + " sent nothing within " +
                std::to_string(timeout_s_) + " s.");
  }
  if (!broken_.empty()) return BrokenLocked();
  if (in.bytes != recv_bytes) {
    return fail("rank " + std::to_string(source) + " sends " +
                std::to_string(in.bytes) + " bytes, " +
                std::to_string(recv_bytes) + " expected.");
  }
  if (recv_bytes > 0) std::memcpy(recv, in.data, recv_bytes);
  in = Mail{nullptr, 0, false, true};
  cv_.notify_all();
  // `send` must stay valid until `dest` has copied it.
  if (!WaitLocked(l, [&] { return out.taken; }) && broken_.empty()) {
    return fail("rank " + std::to_string(dest) + " took nothing within " +
                std::to_string(timeout_s_) + " s.");
  }
  if (!out.taken) return BrokenLocked();
  out.taken = false;
  return Status::OK();
}

LocalCommunicator::LocalCommunicator(std::shared_ptr<LocalGroup> group,
                                     int rank)
    : group_(std::move(group)), rank_(rank) {}

LocalCommunicator::~LocalCommunicator() {
  if (!left_) group_->Leave(rank_, "its LocalCommunicator was destroyed");
}

void LocalCommunicator::Abort(const std::string& why) {
  left_ = true;
  group_->Leave(rank_, why);
}

template <typename Compute, typename Finish>
Status LocalCommunicator::Collective(const LocalSlot& mine, Compute compute,
                                     Finish finish) {
  if (left_) {
    return Status::Aborted("rank " + std::to_string(rank_) +
                           " left its local group; it cannot run " +
                           mine.collective + ".");
  }
  group_->Publish(rank_, mine);
  KD_RETURN_IF_ERROR(group_->Arrive(rank_, mine.collective));
  // Every rank checks every slot, so a bad call fails on all ranks alike.
  Status s = Agree(mine);
  if (s.ok()) s = compute();
  KD_RETURN_IF_ERROR(group_->Arrive(rank_, mine.collective));
  if (s.ok()) finish();
  return s;
}

namespace {

// What each rank must get right on its own.
Status CheckOwn(const LocalSlot& s, int r, int n) {
  if (s.op == ReduceOp::kAverage) {
    return Status::InvalidArgument(
        std::string(s.collective) +
        ": Average never reaches a communicator; send it as Sum "
        "with a postscale (AverageAsSum in scale.h).");
  }
  if (s.root < 0 || s.root >= n) {
    return Status::InvalidArgument(std::string(s.collective) + ": root " +
                                   std::to_string(s.root) + " is not in [0, " +
                                   std::to_string(n) + ").");
  }
  for (const auto* v : {s.sizes, s.recv_sizes}) {
    if (v != nullptr && static_cast<int>(v->size()) != n) {
      return Status::InvalidArgument(std::string(s.collective) + ": rank " +
                                     std::to_string(r) + " passed " +
                                     std::to_string(v->size()) + " sizes for " +
                                     std::to_string(n) + " ranks.");
    }
  }
  return Status::OK();
}

// What rank r must pass as rank 0 did.
Status CheckSame(const LocalSlot& s0, const LocalSlot& s, int r) {
  auto fail = [&](const std::string& what, const std::string& v0,
                  const std::string& vr) {
    return Status::InvalidArgument("local communicator: ranks disagree on " +
                                   what + " of " + s0.collective +
                                   ": rank 0 passed " + v0 + ", rank " +
                                   std::to_string(r) + " passed " + vr + ".");
  };
  if (std::strcmp(s.collective, s0.collective) != 0) {
    return fail("the collective", s0.collective, s.collective);
  }
  if (s.count != s0.count)
    return fail("the count", std::to_string(s0.count), std::to_string(s.count));
  if (s.dtype != s0.dtype)
    return fail("the dtype", DataTypeName(s0.dtype), DataTypeName(s.dtype));
  if (s.op != s0.op)
    return fail("the reduction", ReduceOpName(s0.op), ReduceOpName(s.op));
  if (s.root != s0.root)
    return fail("the root", std::to_string(s0.root), std::to_string(s.root));
  // Allgather and reducescatter: every rank passes the same sizes.
  if (s.sizes != nullptr && s.recv_sizes == nullptr && *s.sizes != *s0.sizes) {
    return fail("the sizes", ShapeString(*s0.sizes), ShapeString(*s.sizes));
  }
  return Status::OK();
}

}  // namespace

// Every rank checks every slot, in the same order, so a bad call fails on
// all ranks alike (with the same message).
Status LocalCommunicator::Agree(const LocalSlot& mine) const {
  const int n = group_->size();
  for (int r = 0; r < n; ++r) {
    KD_RETURN_IF_ERROR(CheckSame(group_->slot(0), group_->slot(r), r));
    KD_RETURN_IF_ERROR(CheckOwn(group_->slot(r), r, n));
  }
  if (mine.recv_sizes == nullptr) return Status::OK();
  // Alltoall: what s sends to r is what r expects from s.
  for (int r = 0; r < n; ++r) {
    for (int s = 0; s < n; ++s) {
      const int64_t sent = (*group_->slot(s).sizes)[r];
      const int64_t expected = (*group_->slot(r).recv_sizes)[s];
      if (sent != expected) {
        return Status::InvalidArgument(
            "local communicator: alltoall: rank " + std::to_string(s) +
            " sends " + std::to_string(sent) + " bytes to rank " +
            std::to_string(r) + ", which expects " + std::to_string(expected) +
            ".");
      }
    }
  }
  return Status::OK();
}

// Reductions combine the ranks' inputs in rank order, so every rank gets the
// same bits.
Status LocalCommunicator::Allreduce(void* buf, int64_t count, DataType dt,
                                    ReduceOp op) {
  return AllreduceFrom(buf, buf, count, dt, op);
}

Status LocalCommunicator::AllreduceFrom(const void* in, void* out,
                                        int64_t count, DataType dt,
                                        ReduceOp op) {
  LocalSlot mine{"allreduce", in, out, count, dt, op};
  const int64_t bytes = count * DataTypeSize(dt);
  return Collective(
      mine,
      [&] {
        scratch_.resize(bytes);
        if (bytes > 0) std::memcpy(scratch_.data(), group_->slot(0).in, bytes);
        for (int r = 1; r < group_->size(); ++r) {
          Combine(scratch_.data(), scratch_.data(), group_->slot(r).in, count,
                  dt, op);
        }
        return Status::OK();
      },
      [&] {
        if (bytes > 0) std::memcpy(out, scratch_.data(), bytes);
      });
}

Status LocalCommunicator::Allgatherv(const void* in, void* out,
                                     const std::vector<int64_t>& bytes) {
  LocalSlot mine{"allgather", in, out};
  mine.sizes = &bytes;
  return Collective(
      mine,
      [&] {
        char* dst = static_cast<char*>(out);
        for (int r = 0; r < group_->size(); ++r) {
          if (bytes[r] > 0) std::memcpy(dst, group_->slot(r).in, bytes[r]);
          dst += bytes[r];
        }
        return Status::OK();
      },
      [] {});
}

Status LocalCommunicator::Gatherv(const void* in, void* out,
                                  const std::vector<int64_t>& bytes, int root) {
  LocalSlot mine{"gather", in, out};
  mine.sizes = &bytes;
  mine.root = root;
  return Collective(
      mine,
      [&] {
        char* dst = static_cast<char*>(out);
        for (int r = 0; rank_ == root && r < group_->size(); ++r) {
          if (bytes[r] > 0) std::memcpy(dst, group_->slot(r).in, bytes[r]);
          dst += bytes[r];
        }
        return Status::OK();
      },
      [] {});
}

Status LocalCommunicator::SendRecv(const void* send, int64_t send_bytes,
                                   int dest, void* recv, int64_t recv_bytes,
                                   int source) {
  if (left_) {
    return Status::Aborted("rank " + std::to_string(rank_) +
                           " left its local group; it cannot run sendrecv.");
  }
  return group_->Exchange(rank_, send, send_bytes, dest, recv, recv_bytes,
                          source);
}

Status LocalCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  LocalSlot mine{"broadcast", buf, buf, bytes};
  mine.root = root;
  return Collective(
      mine,
      [&] {
        if (rank_ != root && bytes > 0)
          std::memcpy(buf, group_->slot(root).in, bytes);
        return Status::OK();
      },
      [] {});
}

Status LocalCommunicator::Alltoallv(const void* in,
                                    const std::vector<int64_t>& send_bytes,
                                    void* out,
                                    const std::vector<int64_t>& recv_bytes) {
  LocalSlot mine{"alltoall", in, out};
  mine.sizes = &send_bytes;
  mine.recv_sizes = &recv_bytes;
  return Collective(
      mine,
      [&] {
        char* dst = static_cast<char*>(out);
        for (int s = 0; s < group_->size(); ++s) {
          const LocalSlot& peer = group_->slot(s);
          const char* src =
              static_cast<const char*>(peer.in) + Sum(*peer.sizes, rank_);
          if (recv_bytes[s] > 0) std::memcpy(dst, src, recv_bytes[s]);
          dst += recv_bytes[s];
        }
        return Status::OK();
      },
      [] {});
}

Status LocalCommunicator::Reducescatter(const void* in, void* out,
                                        const std::vector<int64_t>& counts,
                                        DataType dt, ReduceOp op) {
  LocalSlot mine{"reducescatter", in, out, 0, dt, op};
  mine.sizes = &counts;
  const int64_t es = DataTypeSize(dt);
  return Collective(
      mine,
      [&] {
        const int64_t n = counts[rank_], offset = Sum(counts, rank_) * es;
        scratch_.resize(n * es);
        auto part = [&](int r) {
          return static_cast<const char*>(group_->slot(r).in) + offset;
        };
        if (n > 0) std::memcpy(scratch_.data(), part(0), n * es);
        for (int r = 1; r < group_->size(); ++r) {
          Combine(scratch_.data(), scratch_.data(), part(r), n, dt, op);
        }
        return Status::OK();
      },
      [&] {
        if (!scratch_.empty())
          std::memcpy(out, scratch_.data(), scratch_.size());
      });
}

Status LocalCommunicator::Barrier() {
  return Collective(LocalSlot{"barrier"}, [] { return Status::OK(); }, [] {});
}

}  // namespace kerasdist::core

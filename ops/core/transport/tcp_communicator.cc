#include "tcp_communicator.h"

#include <algorithm>
#include <cstring>

#include "../scale.h"

namespace kerasdist::core {
namespace {

// Where each of `sizes`' blocks starts, and their total, last.
std::vector<int64_t> Offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> at(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) at[i + 1] = at[i] + sizes[i];
  return at;
}

// `count` elements in n blocks, the first count % n one longer.
std::vector<int64_t> EvenBlocks(int64_t count, int n) {
  std::vector<int64_t> sizes(n, count / n);
  for (int i = 0; i < count % n; ++i) ++sizes[i];
  return sizes;
}

int Mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

TcpCommunicator::TcpCommunicator(std::shared_ptr<TcpMesh> mesh,
                                 std::vector<int> members)
    : mesh_(std::move(mesh)), members_(std::move(members)) {
  if (members_.empty()) {
    for (int r = 0; r < mesh_->size(); ++r) members_.push_back(r);
  }
  rank_ = static_cast<int>(
      std::find(members_.begin(), members_.end(), mesh_->rank()) -
      members_.begin());
}

Status TcpCommunicator::Exchange(const char* what, int dest, const void* send,
                                 int64_t send_bytes, int source, void* recv,
                                 int64_t recv_bytes) {
  return mesh_->Exchange(what, dest < 0 ? -1 : members_[dest], send, send_bytes,
                         source < 0 ? -1 : members_[source], recv, recv_bytes);
}

Status TcpCommunicator::Check(const char* what, ReduceOp op, int root,
                              const std::vector<int64_t>* sizes) const {
  if (op == ReduceOp::kAverage) {
    return Status::InvalidArgument(
        std::string(what) +
        ": Average never reaches a communicator; send it as Sum with a "
        "postscale (AverageAsSum in scale.h).");
  }
  if (root < 0 || root >= size()) {
    return Status::InvalidArgument(std::string(what) + ": root " +
                                   std::to_string(root) + " is not in [0, " +
                                   std::to_string(size()) + ").");
  }
  if (sizes != nullptr && static_cast<int>(sizes->size()) != size()) {
    return Status::InvalidArgument(
        std::string(what) + ": " + std::to_string(sizes->size()) +
        " sizes for " + std::to_string(size()) + " ranks.");
  }
  return Status::OK();
}

// A ring reduce-scatter leaves block r + 1 reduced on rank r, then a ring
// allgather passes the reduced blocks around.
Status TcpCommunicator::Allreduce(void* buf, int64_t count, DataType dt,
                                  ReduceOp op) {
  KD_RETURN_IF_ERROR(Check("allreduce", op, 0, nullptr));
  const int n = size(), r = rank();
  if (n == 1 || count == 0) return Status::OK();
  const int64_t width = DataTypeSize(dt);
  if ((n & (n - 1)) == 0 && count * width <= kDoublingBytes) {
    return AllreduceDoubling(buf, count, dt, op);
  }
  const std::vector<int64_t> at = Offsets(EvenBlocks(count, n));
  char* data = static_cast<char*>(buf);
  const int64_t segment = std::max<int64_t>(1, kSegmentBytes / width);
  scratch_.resize(std::min(at[1], segment) * width);
  for (int s = 0; s < n - 1; ++s) {
    const int out = Mod(r - s, n), in = Mod(r - s - 1, n);
    const int64_t out_n = at[out + 1] - at[out], in_n = at[in + 1] - at[in];
    // Segment k of each block; the shorter block runs out first.
    for (int64_t k = 0; k < std::max(out_n, in_n); k += segment) {
      const int64_t sn = std::clamp<int64_t>(out_n - k, 0, segment);
      const int64_t rn = std::clamp<int64_t>(in_n - k, 0, segment);
      KD_RETURN_IF_ERROR(Exchange(
          "allreduce", sn > 0 ? right() : -1, data + (at[out] + k) * width,
          sn * width, rn > 0 ? left() : -1, scratch_.data(), rn * width));
      char* into = data + (at[in] + k) * width;
      if (rn > 0) Combine(into, into, scratch_.data(), rn, dt, op);
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    const int out = Mod(r + 1 - s, n), in = Mod(r - s, n);
    KD_RETURN_IF_ERROR(Exchange("allreduce", right(), data + at[out] * width,
                                (at[out + 1] - at[out]) * width, left(),
                                data + at[in] * width,
                                (at[in + 1] - at[in]) * width));
  }
  return Status::OK();
}

// Each pair combines the same two buffers in the same order (the lower
// rank's first: even a NaN's payload comes out the same on both), so every
// rank ends with the same bits.
Status TcpCommunicator::AllreduceDoubling(void* buf, int64_t count, DataType dt,
                                          ReduceOp op) {
  const int64_t bytes = count * DataTypeSize(dt);
  char* data = static_cast<char*>(buf);
  scratch_.resize(bytes);
  for (int mask = 1; mask < size(); mask <<= 1) {
    const int peer = rank() ^ mask;
    KD_RETURN_IF_ERROR(
        Exchange("allreduce", peer, data, bytes, peer, scratch_.data(), bytes));
    if (peer < rank()) {
      Combine(data, scratch_.data(), data, count, dt, op);
    } else {
      Combine(data, data, scratch_.data(), count, dt, op);
    }
  }
  return Status::OK();
}

Status TcpCommunicator::Allgatherv(const void* in, void* out,
                                   const std::vector<int64_t>& bytes) {
  KD_RETURN_IF_ERROR(Check("allgather", ReduceOp::kSum, 0, &bytes));
  const int n = size(), r = rank();
  const std::vector<int64_t> at = Offsets(bytes);
  char* data = static_cast<char*>(out);
  if (bytes[r] > 0 && data + at[r] != in) {
    std::memmove(data + at[r], in, bytes[r]);
  }
  for (int s = 0; s < n - 1; ++s) {
    const int send = Mod(r - s, n), recv = Mod(r - s - 1, n);
    KD_RETURN_IF_ERROR(Exchange("allgather", right(), data + at[send],
                                bytes[send], left(), data + at[recv],
                                bytes[recv]));
  }
  return Status::OK();
}

Status TcpCommunicator::Gatherv(const void* in, void* out,
                                const std::vector<int64_t>& bytes, int root) {
  KD_RETURN_IF_ERROR(Check("gatherv", ReduceOp::kSum, root, &bytes));
  const int r = rank();
  if (r != root) {
    return Exchange("gatherv", root, in, bytes[r], -1, nullptr, 0);
  }
  const std::vector<int64_t> at = Offsets(bytes);
  char* data = static_cast<char*>(out);
  if (bytes[r] > 0 && data + at[r] != in)
    std::memmove(data + at[r], in, bytes[r]);
  for (int p = 0; p < size(); ++p) {
    if (p == root) continue;
    KD_RETURN_IF_ERROR(
        Exchange("gatherv", -1, nullptr, 0, p, data + at[p], bytes[p]));
  }
  return Status::OK();
}

// A binomial tree from the root: each rank receives once, from the rank
// that differs in its lowest set bit (ranks counted from the root), then
// sends to the ranks below it in the tree.
Status TcpCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  KD_RETURN_IF_ERROR(Check("broadcast", ReduceOp::kSum, root, nullptr));
  const int n = size(), me = Mod(rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (me & mask) {
      KD_RETURN_IF_ERROR(Exchange("broadcast", -1, nullptr, 0,
                                  Mod(me - mask + root, n), buf, bytes));
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (me + mask < n) {
      KD_RETURN_IF_ERROR(Exchange("broadcast", Mod(me + mask + root, n), buf,
                                  bytes, -1, nullptr, 0));
    }
  }
  return Status::OK();
}

Status TcpCommunicator::Alltoallv(const void* in,
                                  const std::vector<int64_t>& send_bytes,
                                  void* out,
                                  const std::vector<int64_t>& recv_bytes) {
  KD_RETURN_IF_ERROR(Check("alltoall", ReduceOp::kSum, 0, &send_bytes));
  KD_RETURN_IF_ERROR(Check("alltoall", ReduceOp::kSum, 0, &recv_bytes));
  const int n = size(), r = rank();
  const std::vector<int64_t> sat = Offsets(send_bytes),
                             rat = Offsets(recv_bytes);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (send_bytes[r] != recv_bytes[r]) {
    return Status::InvalidArgument(
        "alltoall: rank " + std::to_string(r) + " sends itself " +
        std::to_string(send_bytes[r]) + " bytes and expects " +
        std::to_string(recv_bytes[r]) + ".");
  }
  if (send_bytes[r] > 0)
    std::memmove(dst + rat[r], src + sat[r], send_bytes[r]);
  for (int k = 1; k < n; ++k) {
    const int to = Mod(r + k, n), from = Mod(r - k, n);
    KD_RETURN_IF_ERROR(Exchange("alltoall", to, src + sat[to], send_bytes[to],
                                from, dst + rat[from], recv_bytes[from]));
  }
  return Status::OK();
}

// A ring that ends on each rank's own block: at step s rank r passes on its
// running reduction of block r - s - 1 and takes its left neighbour's of
// block r - s - 2, adding its own input; the last lands in `out`.
Status TcpCommunicator::Reducescatter(const void* in, void* out,
                                      const std::vector<int64_t>& counts,
                                      DataType dt, ReduceOp op) {
  KD_RETURN_IF_ERROR(Check("reducescatter", op, 0, &counts));
  const int n = size(), r = rank();
  const int64_t width = DataTypeSize(dt);
  const std::vector<int64_t> at = Offsets(counts);
  const char* src = static_cast<const char*>(in);
  if (n == 1) {
    if (counts[0] > 0 && out != in) std::memmove(out, in, counts[0] * width);
    return Status::OK();
  }
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  scratch_.resize(2 * most * width);
  char* running = scratch_.data();
  char* arrived = running + most * width;
  const char* sending = src + at[Mod(r - 1, n)] * width;
  for (int s = 0; s < n - 1; ++s) {
    const int send = Mod(r - s - 1, n), recv = Mod(r - s - 2, n);
    KD_RETURN_IF_ERROR(Exchange("reducescatter", right(), sending,
                                counts[send] * width, left(), arrived,
                                counts[recv] * width));
    char* into = s == n - 2 ? static_cast<char*>(out) : running;
    Combine(into, arrived, src + at[recv] * width, counts[recv], dt, op);
    sending = running;
  }
  return Status::OK();
}

// Dissemination: in round k each rank signals rank + 2^k and waits for
// rank - 2^k; after log2 n rounds every rank has heard from every other.
Status TcpCommunicator::Barrier() {
  const int n = size(), r = rank();
  for (int step = 1; step < n; step <<= 1) {
    KD_RETURN_IF_ERROR(Exchange("barrier", Mod(r + step, n), nullptr, 0,
                                Mod(r - step, n), nullptr, 0));
  }
  return Status::OK();
}

Status TcpCommunicator::SendRecv(const void* send, int64_t send_bytes, int dest,
                                 void* recv, int64_t recv_bytes, int source) {
  return Exchange("sendrecv", dest, send, send_bytes, source, recv, recv_bytes);
}

void MakeNodeCommunicators(const std::shared_ptr<TcpMesh>& mesh,
                           const std::vector<std::string>& hosts,
                           std::unique_ptr<Communicator>* all,
                           std::unique_ptr<Communicator>* node,
                           std::unique_ptr<Communicator>* leaders) {
  std::vector<int> mine, firsts;
  std::vector<std::string> seen;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (hosts[r] == hosts[mesh->rank()]) mine.push_back(r);
    if (std::find(seen.begin(), seen.end(), hosts[r]) == seen.end()) {
      seen.push_back(hosts[r]);
      firsts.push_back(r);
    }
  }
  *all = std::make_unique<TcpCommunicator>(mesh);
  *node = std::make_unique<TcpCommunicator>(mesh, mine);
  leaders->reset();
  if (mine.front() == mesh->rank()) {
    *leaders = std::make_unique<TcpCommunicator>(mesh, firsts);
  }
}

}  // namespace kerasdist::core

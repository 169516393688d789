// Hierarchical allreduce, for jobs on several hosts with more than one rank
// on some host: each host reduces its ranks' tensors over its own node path
// (in place or shared memory, as a one-host job would), one leader per host
// allreduces the host sums across hosts over MPI, and each leader broadcasts
// the result to its host's ranks. Only the leaders' bytes cross the network:
// 2(H-1)/H x size per host, the minimum for H hosts, however many ranks a
// host runs.
//
// Allgather likewise: each host gathers its ranks' parts on its leader, the
// leaders allgather the hosts' blocks, and each leader broadcasts the whole
// result within its host.
//
// It is a composition of backends, not a transport of its own: the node
// phase runs through the first enabled backend of a node-level list (the
// same factories as the job-wide list, over the node's communicator), the
// cross-host phase through the communicator backend over the leaders'
// communicator (MPI in production; threads in the core's tests).
#include <algorithm>

#include "../host_buffer.h"
#include "../scale.h"
#include "backends.h"
#include "communicator_backend.h"

namespace kerasdist::core {

namespace {

using Clock = std::chrono::steady_clock;

class HierarchicalBackend : public Backend {
 public:
  // `node`: this host's ranks; `leaders`: one rank per host (null but on
  // the leaders); both outlive the backend. `allreduce` / `allgather`:
  // which collectives it takes (agreed by the ranks, as the minimum size
  // is: Enabled must answer alike everywhere).
  HierarchicalBackend(Communicator* node, Communicator* leaders, bool allreduce,
                      bool allgather, int64_t min_bytes)
      : node_(node),
        leaders_(leaders),
        node_rank_(node->rank()),
        node_size_(node->size()),
        min_bytes_(min_bytes),
        allreduce_(allreduce),
        allgather_(allgather) {
    if (leaders != nullptr) {
      cross_ = std::make_unique<CommunicatorBackend>("mpi", leaders,
                                                     leaders->rank());
    }
  }

  // Collective over the node: the list's backends that work within one
  // node (the single-node ones, then MPI), over the node's communicator.
  Status MakeNodeList(const Config& config) {
    NodeContext n;
    n.comm = n.node = node_;
    n.within_node = true;
    return MakeBackends(config, n, &node_list_);
  }

  // Collective over the job: which ranks of `comm` each host holds, in
  // node order (every rank: its own host's; leaders: every host's).
  Status LearnLayout(Communicator* comm);

  const char* Name() const override { return "hier"; }
  bool Enabled(const CollectiveBatch& b) const override {
    if (b.device >= 0) return false;
    if (b.op == OpType::kAllreduce)
      return allreduce_ && b.bytes() >= min_bytes_;
    if (b.op == OpType::kAllgather) {
      int64_t total = 0;
      for (int64_t n : b.recv_bytes) total += n;
      return allgather_ && total >= min_bytes_;
    }
    return false;
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override;
  Status Allgather(CollectiveBatch& b, uint64_t tag) override;

 private:
  Status NodeBroadcast(CollectiveBatch& b);
  Status GatherHostBlock(const CollectiveBatch& b, char* block);
  Status ExchangeHostBlocks(CollectiveBatch& b, const char* block);

  Communicator* node_;
  Communicator* leaders_;
  int node_rank_ = 0, node_size_ = 1;
  int64_t min_bytes_;
  bool allreduce_, allgather_;
  std::vector<int> node_ranks_;               // this host's global ranks
  std::vector<int64_t> gather_bytes_;         // GatherHostBlock's layout
  std::vector<std::vector<int>> host_ranks_;  // leaders: every host's
  HostBuffer block_, all_;
  BackendList node_list_;
  std::unique_ptr<Backend> cross_;  // leaders only
  HostBuffer pack_;
};

// Scaling: the prescale goes into the node phase (each input once), the
// postscale (with Average's 1/size or integer division) after the cross
// phase, on the leader before it broadcasts, so every rank gets the same
// bits and integer sums match the flat path's exactly.
Status HierarchicalBackend::Allreduce(CollectiveBatch& b, uint64_t tag) {
  CollectiveBatch node = b;
  node.postscale = 1.0;
  node.divisor = 1;
  Backend* first = ChooseBackend(node_list_, node);
  KD_RETURN_IF_ERROR(first->Run(node, tag));
  b.packed = Clock::now();
  if (cross_) {
    CollectiveBatch cross = b;
    cross.prescale = 1.0;
    cross.postscale = b.postscale;
    cross.divisor = b.divisor;
    for (BatchTensor& t : cross.tensors) t.input = t.output;
    KD_RETURN_IF_ERROR(cross_->Run(cross, tag));
  }
  b.reduced = Clock::now();
  KD_RETURN_IF_ERROR(NodeBroadcast(b));
  b.backend = Name();
  b.phases = kHierarchicalPhases;
  return Status::OK();
}

// The leader's outputs to the node's other ranks, packed into one buffer
// when the batch holds several tensors.
Status HierarchicalBackend::NodeBroadcast(CollectiveBatch& b) {
  if (node_size_ == 1) return Status::OK();
  const int64_t esize = DataTypeSize(b.dtype);
  if (b.tensors.size() == 1) {
    BatchTensor& t = b.tensors[0];
    return node_->Broadcast(t.output, t.count * esize, 0);
  }
  char* buf = pack_.Reserve(b.bytes());
  int64_t off = 0;
  if (node_rank_ == 0) {
    for (const BatchTensor& t : b.tensors) {
      std::copy_n(static_cast<const char*>(t.output), t.count * esize,
                  buf + off);
      off += t.count * esize;
    }
  }
  KD_RETURN_IF_ERROR(node_->Broadcast(buf, b.bytes(), 0));
  if (node_rank_ == 0) return Status::OK();
  off = 0;
  for (BatchTensor& t : b.tensors) {
    std::copy_n(buf + off, t.count * esize, static_cast<char*>(t.output));
    off += t.count * esize;
  }
  return Status::OK();
}

Status HierarchicalBackend::LearnLayout(Communicator* comm) {
  const int rank = comm->rank();
  node_ranks_.resize(node_size_);
  KD_RETURN_IF_ERROR(node_->Allgather(&rank, node_ranks_.data(), sizeof(int)));
  if (leaders_ == nullptr) return Status::OK();
  const int hosts = leaders_->size();
  std::vector<int> sizes(hosts);
  KD_RETURN_IF_ERROR(
      leaders_->Allgather(&node_size_, sizes.data(), sizeof(int)));
  std::vector<int64_t> bytes(hosts);
  int total = 0;
  for (int h = 0; h < hosts; ++h) {
    bytes[h] = sizes[h] * static_cast<int64_t>(sizeof(int));
    total += sizes[h];
  }
  std::vector<int> all(total);
  KD_RETURN_IF_ERROR(
      leaders_->Allgatherv(node_ranks_.data(), all.data(), bytes));
  host_ranks_.assign(hosts, {});
  auto at = all.begin();
  for (int h = 0; h < hosts; ++h) {
    host_ranks_[h].assign(at, at + sizes[h]);
    at += sizes[h];
  }
  return Status::OK();
}

// Ranks' parts at their offsets in the global result: every host's block
// reaches every leader, which puts each rank's part where the flat
// allgather would, then broadcasts the whole result within its host.
Status HierarchicalBackend::Allgather(CollectiveBatch& b, uint64_t) {
  int64_t block_bytes = 0;
  for (int g : node_ranks_) block_bytes += b.recv_bytes[g];
  char* block = block_.Reserve(std::max<int64_t>(block_bytes, 1));
  KD_RETURN_IF_ERROR(GatherHostBlock(b, block));
  if (node_rank_ == 0) KD_RETURN_IF_ERROR(ExchangeHostBlocks(b, block));
  int64_t total = 0;
  for (int64_t n : b.recv_bytes) total += n;
  if (node_size_ == 1 || total == 0) return Status::OK();
  return node_->Broadcast(b.tensors[0].output, total, 0);
}

// This host's ranks' parts, in node order, into the leader's `block`.
Status HierarchicalBackend::GatherHostBlock(const CollectiveBatch& b,
                                            char* block) {
  gather_bytes_.resize(node_size_);
  for (int i = 0; i < node_size_; ++i)
    gather_bytes_[i] = b.recv_bytes[node_ranks_[i]];
  return node_->Gatherv(b.tensors[0].input, block, gather_bytes_, 0);
}

Status HierarchicalBackend::ExchangeHostBlocks(CollectiveBatch& b,
                                               const char* block) {
  const int hosts = static_cast<int>(host_ranks_.size());
  std::vector<int64_t> offset(b.recv_bytes.size() + 1, 0);
  for (size_t g = 0; g < b.recv_bytes.size(); ++g)
    offset[g + 1] = offset[g] + b.recv_bytes[g];
  std::vector<int64_t> block_bytes(hosts, 0);
  for (int h = 0; h < hosts; ++h) {
    for (int g : host_ranks_[h]) block_bytes[h] += b.recv_bytes[g];
  }
  int64_t all_bytes = 0;
  for (int64_t n : block_bytes) all_bytes += n;
  char* all = all_.Reserve(std::max<int64_t>(all_bytes, 1));
  KD_RETURN_IF_ERROR(leaders_->Allgatherv(block, all, block_bytes));
  char* out = static_cast<char*>(b.tensors[0].output);
  int64_t at = 0;
  for (int h = 0; h < hosts; ++h) {
    for (int g : host_ranks_[h]) {
      std::copy_n(all + at, b.recv_bytes[g], out + offset[g]);
      at += b.recv_bytes[g];
    }
  }
  return Status::OK();
}

}  // namespace

// KERASDIST_HIERARCHICAL_ALLREDUCE, KERASDIST_HIERARCHICAL_ALLGATHER,
// KERASDIST_HIERARCHICAL_MIN_BYTES. Not in a node-level list (its own).
Status MakeHierarchicalBackend(const Config& config, const NodeContext& ctx,
                               std::unique_ptr<Backend>* out) {
  out->reset();
  if (ctx.within_node) return Status::OK();
  // Every rank must agree whether to build it and what it takes: the
  // settings may differ between ranks.
  int32_t agreed[2] = {config.Flag("KERASDIST_HIERARCHICAL_ALLREDUCE"),
                       config.Flag("KERASDIST_HIERARCHICAL_ALLGATHER")};
  KD_RETURN_IF_ERROR(
      ctx.comm->Allreduce(agreed, 2, DataType::kInt32, ReduceOp::kMin));
  if (!agreed[0] && !agreed[1]) return Status::OK();
  int64_t min_bytes = 0;
  KD_RETURN_IF_ERROR(AgreeLargest(
      *ctx.comm, config.Int("KERASDIST_HIERARCHICAL_MIN_BYTES"), &min_bytes));
  // How many hosts, and the most ranks on one.
  int32_t hosts = ctx.node->rank() == 0 ? 1 : 0, largest = ctx.node->size();
  KD_RETURN_IF_ERROR(
      ctx.comm->Allreduce(&hosts, 1, DataType::kInt32, ReduceOp::kSum));
  KD_RETURN_IF_ERROR(
      ctx.comm->Allreduce(&largest, 1, DataType::kInt32, ReduceOp::kMax));
  if (hosts < 2 || largest < 2) return Status::OK();
  auto h = std::make_unique<HierarchicalBackend>(
      ctx.node, ctx.leaders, agreed[0] != 0, agreed[1] != 0, min_bytes);
  KD_RETURN_IF_ERROR(h->MakeNodeList(config));
  KD_RETURN_IF_ERROR(h->LearnLayout(ctx.comm));
  *out = std::move(h);
  return Status::OK();
}

}  // namespace kerasdist::core

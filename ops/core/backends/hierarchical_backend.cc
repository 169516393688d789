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
// cross-host phase through the MPI backend over the leaders' communicator.
#include <algorithm>

#include "../host_buffer.h"
#include "../scale.h"
#include "../transport/mpi_context.h"
#include "backends.h"
#include "communicator_backend.h"

namespace kerasdist::core {

namespace {

using Clock = std::chrono::steady_clock;

class HierarchicalBackend : public Backend {
 public:
  // `allreduce` / `allgather`: which collectives it takes (agreed by the
  // ranks, as the minimum size is: Enabled must answer alike everywhere).
  HierarchicalBackend(MPI_Comm node, MPI_Comm leaders, bool allreduce,
                      bool allgather, int64_t min_bytes)
      : node_comm_(node),
        leader_comm_(leaders),
        min_bytes_(min_bytes),
        allreduce_(allreduce),
        allgather_(allgather) {
    MPI_Comm_rank(node, &node_rank_);
    MPI_Comm_size(node, &node_size_);
    node_mpi_ = MakeMpiCommunicator(node);
    if (leaders != MPI_COMM_NULL) {
      int leader_rank = 0;
      MPI_Comm_rank(leaders, &leader_rank);
      leader_mpi_ = MakeMpiCommunicator(leaders);
      cross_ = std::make_unique<CommunicatorBackend>("mpi", leader_mpi_.get(),
                                                     leader_rank);
    }
  }
  ~HierarchicalBackend() override {
    node_list_.clear();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (leader_comm_ != MPI_COMM_NULL) MPI_Comm_free(&leader_comm_);
    MPI_Comm_free(&node_comm_);
  }

  // Collective over the node: the list's backends that work within one
  // node (the single-node ones, then MPI), over the node's communicator.
  Status MakeNodeList(const Config& config) {
    NodeContext n;
    n.comm = node_comm_;
    n.rank = n.local_rank = node_rank_;
    n.size = n.local_size = node_size_;
    n.host = node_mpi_.get();
    n.within_node = true;
    return MakeBackends(config, n, &node_list_);
  }

  // Collective over the job: which global ranks each host holds, in node
  // order (every rank: its own host's; leaders: every host's).
  Status LearnLayout(MPI_Comm comm);

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

  MPI_Comm node_comm_, leader_comm_;
  int node_rank_ = 0, node_size_ = 1;
  int64_t min_bytes_;
  bool allreduce_, allgather_;
  std::vector<int> node_ranks_;               // this host's global ranks
  std::vector<std::vector<int>> host_ranks_;  // leaders: every host's
  HostBuffer block_, all_;
  std::unique_ptr<Communicator> node_mpi_, leader_mpi_;
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
    return node_mpi_->Broadcast(t.output, t.count * esize, 0);
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
  KD_RETURN_IF_ERROR(node_mpi_->Broadcast(buf, b.bytes(), 0));
  if (node_rank_ == 0) return Status::OK();
  off = 0;
  for (BatchTensor& t : b.tensors) {
    std::copy_n(buf + off, t.count * esize, static_cast<char*>(t.output));
    off += t.count * esize;
  }
  return Status::OK();
}

Status HierarchicalBackend::LearnLayout(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  node_ranks_.resize(node_size_);
  KD_RETURN_IF_ERROR(
      MpiStatus(MPI_Allgather(&rank, 1, MPI_INT, node_ranks_.data(), 1, MPI_INT,
                              node_comm_),
                "MPI_Allgather"));
  if (leader_comm_ == MPI_COMM_NULL) return Status::OK();
  int hosts = 0;
  MPI_Comm_size(leader_comm_, &hosts);
  std::vector<int> sizes(hosts), displs(hosts, 0);
  KD_RETURN_IF_ERROR(
      MpiStatus(MPI_Allgather(&node_size_, 1, MPI_INT, sizes.data(), 1, MPI_INT,
                              leader_comm_),
                "MPI_Allgather"));
  for (int h = 1; h < hosts; ++h) displs[h] = displs[h - 1] + sizes[h - 1];
  std::vector<int> all(displs[hosts - 1] + sizes[hosts - 1]);
  KD_RETURN_IF_ERROR(MpiStatus(
      MPI_Allgatherv(node_ranks_.data(), node_size_, MPI_INT, all.data(),
                     sizes.data(), displs.data(), MPI_INT, leader_comm_),
      "MPI_Allgatherv"));
  host_ranks_.assign(hosts, {});
  for (int h = 0; h < hosts; ++h) {
    host_ranks_[h].assign(all.begin() + displs[h],
                          all.begin() + displs[h] + sizes[h]);
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
  return node_mpi_->Broadcast(b.tensors[0].output, total, 0);
}

// This host's ranks' parts, in node order, into the leader's `block`.
Status HierarchicalBackend::GatherHostBlock(const CollectiveBatch& b,
                                            char* block) {
  std::vector<int> counts(node_size_), displs(node_size_, 0);
  for (int i = 0; i < node_size_; ++i) {
    counts[i] = static_cast<int>(b.recv_bytes[node_ranks_[i]]);
    if (i > 0) displs[i] = displs[i - 1] + counts[i - 1];
  }
  return MpiStatus(
      MPI_Gatherv(b.tensors[0].input, counts[node_rank_], MPI_BYTE, block,
                  counts.data(), displs.data(), MPI_BYTE, 0, node_comm_),
      "MPI_Gatherv");
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
  KD_RETURN_IF_ERROR(leader_mpi_->Allgatherv(block, all, block_bytes));
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
  int mine[2] = {config.hierarchical_allreduce ? 1 : 0,
                 config.hierarchical_allgather ? 1 : 0};
  int agreed[2] = {0, 0};
  KD_RETURN_IF_ERROR(
      MpiStatus(MPI_Allreduce(mine, agreed, 2, MPI_INT, MPI_MIN, ctx.comm),
                "MPI_Allreduce"));
  if (!agreed[0] && !agreed[1]) return Status::OK();
  int64_t min_bytes = 0;
  KD_RETURN_IF_ERROR(
      AgreeLargest(ctx.comm, config.hierarchical_min_bytes, &min_bytes));
  MPI_Comm node, leaders;
  int hosts = 1, largest = 1;
  KD_RETURN_IF_ERROR(
      NodeAndLeaderComms(ctx.comm, &node, &leaders, &hosts, &largest));
  auto h = std::make_unique<HierarchicalBackend>(node, leaders, agreed[0] != 0,
                                                 agreed[1] != 0, min_bytes);
  if (hosts < 2 || largest < 2) return Status::OK();  // h frees the comms
  KD_RETURN_IF_ERROR(h->MakeNodeList(config));
  KD_RETURN_IF_ERROR(h->LearnLayout(ctx.comm));
  *out = std::move(h);
  return Status::OK();
}

}  // namespace kerasdist::core

// Hierarchical allreduce, for jobs on several hosts with more than one rank
// on some host: each host reduces its ranks' tensors over its own node path
// (in place or shared memory, as a one-host job would), one leader per host
// allreduces the host sums across hosts over MPI, and each leader broadcasts
// the result to its host's ranks. Only the leaders' bytes cross the network:
// 2(H-1)/H x size per host, the minimum for H hosts, however many ranks a
// host runs.
//
// It is a composition of backends, not a transport of its own: the node
// phase runs through the first enabled backend of a node-level list (the
// same factories as the job-wide list, over the node's communicator), the
// cross-host phase through the MPI backend over the leaders' communicator.
#include <algorithm>

#include "../host_buffer.h"
#include "../scale.h"
#include "backends.h"
#include "communicator_backend.h"
#include "mpi_context.h"

namespace kerasdist::core {

namespace {

using Clock = std::chrono::steady_clock;

class HierarchicalBackend : public Backend {
 public:
  HierarchicalBackend(const BackendOptions& o, MPI_Comm node, MPI_Comm leaders)
      : node_comm_(node), leader_comm_(leaders), min_bytes_(o.hierarchical_min_bytes) {
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

  // Collective over the node: its single-node backends, then MPI.
  Status MakeNodeList(const BackendOptions& o) {
    BackendOptions n = o;
    n.comm = node_comm_;
    n.rank = node_rank_;
    n.size = node_size_;
    n.host = node_mpi_.get();
    auto mpi = std::make_unique<CommunicatorBackend>("mpi", n.host, n.rank);
    node_list_.push_back(std::make_unique<SelfBackend>(n.size));
    std::unique_ptr<Backend> shm, cma;
    KD_RETURN_IF_ERROR(MakeShmBackend(n, mpi.get(), &shm, &n.shm_min_bytes));
    if (shm) {
      KD_RETURN_IF_ERROR(MakeCmaBackend(n, &cma));
      if (cma) node_list_.push_back(std::move(cma));
      node_list_.push_back(std::move(shm));
    }
    node_list_.push_back(std::move(mpi));
    return Status::OK();
  }

  const char* Name() const override { return "hier"; }
  bool Enabled(const CollectiveBatch& b) const override {
    return b.op == OpType::kAllreduce && b.device < 0 && b.bytes() >= min_bytes_;
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override;

 private:
  Status NodeBroadcast(CollectiveBatch& b);

  MPI_Comm node_comm_, leader_comm_;
  int node_rank_ = 0, node_size_ = 1;
  int64_t min_bytes_;
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
  b.transport = Name();
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
      std::copy_n(static_cast<const char*>(t.output), t.count * esize, buf + off);
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

}  // namespace

Status MakeHierarchicalBackend(const BackendOptions& o, std::unique_ptr<Backend>* out) {
  out->reset();
  // Every rank must agree whether to build it: the setting may differ.
  int mine = o.hierarchical ? 1 : 0, agreed = 0;
  KD_RETURN_IF_ERROR(MpiStatus(
      MPI_Allreduce(&mine, &agreed, 1, MPI_INT, MPI_MIN, o.comm), "MPI_Allreduce"));
  if (agreed == 0) return Status::OK();
  MPI_Comm node, leaders;
  int hosts = 1, largest = 1;
  KD_RETURN_IF_ERROR(NodeAndLeaderComms(o.comm, &node, &leaders, &hosts, &largest));
  auto h = std::make_unique<HierarchicalBackend>(o, node, leaders);
  if (hosts < 2 || largest < 2) return Status::OK();  // h frees the comms
  KD_RETURN_IF_ERROR(h->MakeNodeList(o));
  *out = std::move(h);
  return Status::OK();
}

}  // namespace kerasdist::core

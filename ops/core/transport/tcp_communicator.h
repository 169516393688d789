// The collectives of communicator.h over a TcpMesh (tcp_mesh.h): a
// transport that a running process can drop and form again, for recovery
// in place across hosts. Host memory only.
//
// Algorithms (as MPI's and gloo's): allreduce of at most kDoublingBytes
// over a power of two of ranks is a recursive doubling (log2 n exchanges
// of the whole buffer: the fewest round trips), a larger one a ring
// reduce-scatter then a ring allgather, each rank sending and receiving
// (n - 1) / n of the buffer twice, the reduce-scatter in segments of at
// most kSegmentBytes so that its scratch stays small; allgather and
// reducescatter are rings; broadcast a binomial tree; alltoall n - 1
// pairwise exchanges; gatherv every rank to the root; the barrier a
// dissemination (log2 n rounds). Every rank ends an allreduce with the
// same bits: each element is reduced on one rank and copied to the others.
// Errors are the mesh's: a lost, frozen or disagreeing peer fails the call
// with a Status naming it, and the communicator is broken from then on.
#ifndef KERASDIST_CORE_TRANSPORT_TCP_COMMUNICATOR_H_
#define KERASDIST_CORE_TRANSPORT_TCP_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "communicator.h"
#include "tcp_mesh.h"

namespace kerasdist::core {

class TcpCommunicator : public Communicator {
 public:
  static constexpr int64_t kSegmentBytes = 4 << 20;
  static constexpr int64_t kDoublingBytes = 256 << 10;

  // Over every rank of `mesh`, or over `members` (mesh ranks, in this
  // communicator's order; this rank among them): the node's and the
  // leaders' communicators share the job's mesh (MakeNodeCommunicators).
  // Communicators that share a mesh must be called from one thread, in
  // the same order on every rank (the runtime's thread does).
  explicit TcpCommunicator(std::shared_ptr<TcpMesh> mesh,
                           std::vector<int> members = {});
  std::string Name() const override { return "tcp"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  TcpMesh& mesh() { return *mesh_; }

  Status Allreduce(void* buf, int64_t count, DataType dt, ReduceOp op) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override;
  Status Gatherv(const void* in, void* out, const std::vector<int64_t>& bytes,
                 int root) override;
  Status Broadcast(void* buf, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override;
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override;
  Status Barrier() override;
  Status SendRecv(const void* send, int64_t send_bytes, int dest, void* recv,
                  int64_t recv_bytes, int source) override;

 private:
  Status AllreduceDoubling(void* buf, int64_t count, DataType dt, ReduceOp op);
  Status Check(const char* what, ReduceOp op, int root,
               const std::vector<int64_t>* sizes) const;
  int right() const { return (rank() + 1) % size(); }
  int left() const { return (rank() + size() - 1) % size(); }
  // Exchange with this communicator's ranks (-1: none).
  Status Exchange(const char* what, int dest, const void* send,
                  int64_t send_bytes, int source, void* recv,
                  int64_t recv_bytes);

  std::shared_ptr<TcpMesh> mesh_;
  std::vector<int> members_;  // mesh ranks, by this communicator's rank
  int rank_ = 0;
  std::vector<char> scratch_;
};

// The backends' communicators over a job's mesh, as MpiContext makes them
// over MPI (backends.h, NodeContext): every rank (*all), this rank's host's
// ranks (*node, in rank order), and on each host's first rank one over the
// hosts' first ranks (*leaders, hosts in the order of their first rank;
// null elsewhere). `hosts`: each rank's host name, by rank.
void MakeNodeCommunicators(const std::shared_ptr<TcpMesh>& mesh,
                           const std::vector<std::string>& hosts,
                           std::unique_ptr<Communicator>* all,
                           std::unique_ptr<Communicator>* node,
                           std::unique_ptr<Communicator>* leaders);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_COMMUNICATOR_H_

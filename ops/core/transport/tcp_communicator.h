// The collectives of communicator.h over a TcpMesh (tcp_mesh.h): a
// transport that a running process can drop and form again, for recovery
// in place across hosts. Host memory only.
//
// Algorithms (as MPI's and gloo's for large messages): allreduce is a ring
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
#include <vector>

#include "communicator.h"
#include "tcp_mesh.h"

namespace kerasdist::core {

class TcpCommunicator : public Communicator {
 public:
  static constexpr int64_t kSegmentBytes = 4 << 20;

  explicit TcpCommunicator(std::unique_ptr<TcpMesh> mesh)
      : mesh_(std::move(mesh)) {}
  std::string Name() const override { return "tcp"; }
  int rank() const override { return mesh_->rank(); }
  int size() const override { return mesh_->size(); }
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
  Status Check(const char* what, ReduceOp op, int root,
               const std::vector<int64_t>* sizes) const;
  int right() const { return (rank() + 1) % size(); }
  int left() const { return (rank() + size() - 1) % size(); }

  std::unique_ptr<TcpMesh> mesh_;
  std::vector<char> scratch_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_TCP_COMMUNICATOR_H_

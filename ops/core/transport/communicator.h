// The data plane: collectives on flat buffers, implemented by MPI (host
// memory), NCCL (device memory) and, for the core's tests, ranks as threads
// of one process (local_communicator.h). Every call is blocking for the
// calling (background) thread and returns a Status; an unsupported
// collective fails loudly rather than silently doing something else.
//
// The backends see only this interface: the runtime hands them the ranks a
// backend list serves, this host's ranks among them and one leader per host
// (backends.h, NodeContext), so that their algorithms run unchanged over MPI
// processes and over threads.
#ifndef KERASDIST_CORE_TRANSPORT_COMMUNICATOR_H_
#define KERASDIST_CORE_TRANSPORT_COMMUNICATOR_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../status.h"
#include "../types.h"

namespace kerasdist::core {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string Name() const = 0;
  // This rank's number in the communicator, and how many ranks it holds.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place. `op` is never Average: the runtime turns it into Sum + scaling.
  virtual Status Allreduce(void* buf, int64_t count, DataType dt,
                           ReduceOp op) = 0;
  // Out of place (`in` != `out`); the default copies, then reduces in place.
  virtual Status AllreduceFrom(const void* in, void* out, int64_t count,
                               DataType dt, ReduceOp op) {
    if (in != out && count > 0) std::memcpy(out, in, count * DataTypeSize(dt));
    return Allreduce(out, count, dt, op);
  }
  // `bytes[r]` is rank r's contribution; `out` holds their concatenation.
  virtual Status Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes) = 0;
  // Allgatherv with `bytes` from every rank.
  virtual Status Allgather(const void* in, void* out, int64_t bytes) {
    return Allgatherv(in, out, std::vector<int64_t>(size(), bytes));
  }
  // Allgatherv whose result lands on `root` only (`out` unused elsewhere).
  virtual Status Gatherv(const void* in, void* out,
                         const std::vector<int64_t>& bytes, int root) {
    return Unsupported("gatherv");
  }
  virtual Status Broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual Status Alltoallv(const void* in,
                           const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) = 0;
  // `counts[r]` elements of the reduction land on rank r.
  virtual Status Reducescatter(const void* in, void* out,
                               const std::vector<int64_t>& counts, DataType dt,
                               ReduceOp op) = 0;
  virtual Status Barrier() = 0;
  // Point to point: sends `send_bytes` of `send` to rank `dest` and
  // receives `recv_bytes` from rank `source` into `recv` (which each call
  // SendRecv to match, at the same point). Only those ranks take part.
  virtual Status SendRecv(const void* send, int64_t send_bytes, int dest,
                          void* recv, int64_t recv_bytes, int source) {
    return Unsupported("sendrecv");
  }

 protected:
  Status Unsupported(const char* what) const {
    return Status::Internal("the " + Name() + " communicator does not " +
                            "implement " + what + " (kerasdist bug).");
  }
};

// Collective over `comm`: *all is whether every rank passed `mine` true.
// Settings may differ between ranks; the paths they choose must not.
inline Status AgreeAll(Communicator& comm, bool mine, bool* all) {
  int32_t v = mine ? 1 : 0;
  KD_RETURN_IF_ERROR(comm.Allreduce(&v, 1, DataType::kInt32, ReduceOp::kMin));
  *all = v != 0;
  return Status::OK();
}

// Collective over `comm`: *largest is the largest `mine` of all ranks.
inline Status AgreeLargest(Communicator& comm, int64_t mine, int64_t* largest) {
  int64_t v = mine;
  KD_RETURN_IF_ERROR(comm.Allreduce(&v, 1, DataType::kInt64, ReduceOp::kMax));
  *largest = v;
  return Status::OK();
}

// Collective over `comm`: every rank's `mine` in, one verdict out: `mine`
// where it failed, else an error naming the lowest rank whose start
// failed, else OK (communicator.cc).
Status AgreeStarted(Communicator& comm, const Status& mine);

// Collective over `node` (one node's ranks): whether they outnumber the
// CPUs they may run on together (the union of their affinity masks).
Status NodeOversubscribed(Communicator& node, bool* oversubscribed);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_COMMUNICATOR_H_

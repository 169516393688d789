// The data plane: collectives on flat buffers, implemented by MPI (host
// memory) and NCCL (device memory). Every call is blocking for the calling
// (background) thread and returns a Status; an unsupported collective fails
// loudly rather than silently doing something else.
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
  virtual Status Broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual Status Alltoallv(const void* in,
                           const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) = 0;
  // `counts[r]` elements of the reduction land on rank r.
  virtual Status Reducescatter(const void* in, void* out,
                               const std::vector<int64_t>& counts, DataType dt,
                               ReduceOp op) = 0;
  virtual Status Barrier() = 0;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TRANSPORT_COMMUNICATOR_H_

// One tensor handed to the runtime, and how it ends: what the C API
// (enqueue.cc) makes of a front end's kerasdist_tensor. No MPI, no runtime
// internals.
#ifndef KERASDIST_CORE_ENTRY_H_
#define KERASDIST_CORE_ENTRY_H_

#include <chrono>
#include <functional>
#include <vector>

#include "message.h"
#include "status.h"

namespace kerasdist::core {

struct Result {
  Status status;
  std::vector<int64_t> recv_splits;  // alltoall: rows received from each rank
};

// `output` is the preallocated result for allreduce and broadcast (it may
// equal `input`); allgather, alltoall and reducescatter learn their output
// shape from negotiation and call `allocate`. `done` is called exactly once,
// from the background thread.
struct Entry {
  Request req;
  const void* input = nullptr;
  void* output = nullptr;
  std::function<Status(const std::vector<int64_t>& shape, void** data)>
      allocate;
  std::function<void(const Result&)> done;
  // Device tensors (req.device >= 0) only, optional: a cudaEvent_t recorded
  // on the stream that produces `input` (TF's compute stream), owned by the
  // front end and valid until `done`. The communication stream waits on it;
  // null means the input is already complete (e.g. a front end after a
  // sync).
  void* ready_event = nullptr;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_ENTRY_H_

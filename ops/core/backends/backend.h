// The data path's one interface: a Backend runs a batch of collectives that
// the coordinator scheduled (a fused allreduce, or one tensor of another
// collective). The runtime keeps an ordered list of backends (MakeBackends,
// backends.cc) and gives each batch to the first one whose Enabled() says
// yes, as Horovod's OperationManager does; a collective a backend does not
// implement fails loudly, naming the backend and the collective, as c10d's
// Backend does.
//
// Every rank walks the same list for the same batch at the same point of the
// coordinator's order, so Enabled() must give the same answer on every rank:
// decide from the batch (sizes, dtype, op, device) and facts agreed at
// start-up, never from something local such as free memory.
//
// A backend sees only this header's types: no Request, Response or runtime
// state. The runtime turns negotiation's answer into a CollectiveBatch
// (layouts, scaling, outputs allocated) before it calls Run.
#ifndef KERASDIST_CORE_BACKENDS_BACKEND_H_
#define KERASDIST_CORE_BACKENDS_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../status.h"
#include "../types.h"

namespace kerasdist::core {

// One tensor of a batch: `count` elements of `input`, the result written to
// `output` (which may equal `input`).
struct BatchTensor {
  const std::string* name = nullptr;  // for error messages
  const void* input = nullptr;
  void* output = nullptr;
  int64_t count = 0;
  // Device tensors only, optional: a cudaEvent_t on the producer's stream
  // that the communication stream must wait for (null: already complete).
  void* ready_event = nullptr;
};

// A batch as a backend runs it. Allreduce batches may hold many tensors of
// one dtype (Tensor Fusion); every other collective holds exactly one.
struct CollectiveBatch {
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  // Allreduce and reducescatter: the reduction on the wire (never Average:
  // the runtime turns it into Sum plus scaling), the factor applied to each
  // input before it, and the one applied to the result after it (integers
  // also divided by `divisor`, as ScaleCopy does).
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int64_t divisor = 1;
  int root_rank = 0;  // broadcast
  int device = -1;    // -1: host memory; else the CUDA ordinal
  std::vector<BatchTensor> tensors;
  // Byte and element layouts for the collectives whose sizes differ by rank
  // (layout.h computes them from negotiation's answer).
  std::vector<int64_t> send_bytes;  // alltoall: to each rank
  std::vector<int64_t> recv_bytes;  // allgather, alltoall: from each rank
  std::vector<int64_t> counts;  // reducescatter: elements landing on each rank

  // Set by the backend that ran the batch, for the timeline: its name, and
  // when it finished packing (copy in) and reducing, where it fused. A
  // backend that hands a batch to another (a fallback, a composition) leaves
  // the other's marks.
  const char* backend = "";
  std::chrono::steady_clock::time_point packed{}, reduced{};
  // The timeline's names for the three phases those marks divide the batch
  // into; null: the fusion buffer's (copy in, the collective, copy out).
  const char* const* phases = nullptr;

  int64_t elements() const;
  int64_t bytes() const { return elements() * DataTypeSize(dtype); }
};

// The timeline's names for a hierarchical allreduce's three phases (within
// each host, across hosts, back within each host).
inline constexpr const char* kHierarchicalPhases[3] = {
    "NODE_ALLREDUCE", "CROSS_ALLREDUCE", "NODE_BROADCAST"};

// The end of an asynchronous batch (see Backend::Poll).
struct Completion {
  uint64_t tag = 0;
  Status status;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Short and stable: the timeline's `backend` field and `kerasdist
  // doctor` show it ("mpi", "shm", "cma", "nccl", ...).
  virtual const char* Name() const = 0;
  // Whether this backend runs `b`; the same answer on every rank.
  virtual bool Enabled(const CollectiveBatch& b) const = 0;

  // Runs `b` (dispatching on b.op). A synchronous backend has finished when
  // it returns. An asynchronous one (Asynchronous() true: a GPU stream) may
  // only have queued the work: the batch ends when Poll reports `tag`, and
  // its buffers stay in use until then. An error returned here means the
  // batch failed (and, for an asynchronous backend, will not be reported by
  // Poll); kInternal means the backend may be broken on some ranks only.
  Status Run(CollectiveBatch& b, uint64_t tag);

  // Asynchronous backends only.
  virtual bool Asynchronous() const { return false; }
  // Appends the batches that have finished since the last call (never waits).
  virtual void Poll(std::vector<Completion>* done) {}
  // Waits up to `timeout_s` for what is in flight, then abandons the rest,
  // reporting it with `abort_status`.
  virtual void Drain(double timeout_s, const Status& abort_status,
                     std::vector<Completion>* done) {}
  virtual bool Busy() const { return false; }

 protected:
  // One per collective; the defaults fail with Unsupported(). `tag` matters
  // to asynchronous backends only.
  virtual Status Allreduce(CollectiveBatch& b, uint64_t tag);
  virtual Status Allgather(CollectiveBatch& b, uint64_t tag);
  virtual Status Broadcast(CollectiveBatch& b, uint64_t tag);
  virtual Status Alltoall(CollectiveBatch& b, uint64_t tag);
  virtual Status Reducescatter(CollectiveBatch& b, uint64_t tag);
  virtual Status Barrier(CollectiveBatch& b, uint64_t tag);
  // "the 'shm' backend does not implement allgather (...)": a kerasdist bug
  // (its Enabled() accepted a batch it cannot run).
  Status Unsupported(OpType op) const;
};

// An ordered list of backends: a batch runs on the first enabled one.
using BackendList = std::vector<std::unique_ptr<Backend>>;

// The first backend of `list` enabled for `b`, or null.
Backend* ChooseBackend(const BackendList& list, const CollectiveBatch& b);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_BACKEND_H_

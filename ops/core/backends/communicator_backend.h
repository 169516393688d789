// The backend over any Communicator (flat-buffer collectives): MPI on host
// memory in production, the in-process communicator in tests. Allreduce
// batches are fused: each input is copied (with its prescale) into one
// buffer, reduced with one collective, and copied out (with the postscale);
// a single tensor goes straight from its input to its output.
#ifndef KERASDIST_CORE_BACKENDS_COMMUNICATOR_BACKEND_H_
#define KERASDIST_CORE_BACKENDS_COMMUNICATOR_BACKEND_H_

#include <memory>

#include "../host_buffer.h"
#include "../transport/communicator.h"
#include "backend.h"

namespace kerasdist::core {

class CommunicatorBackend : public Backend {
 public:
  // `comm` must outlive the backend. `name` is what the timeline shows.
  CommunicatorBackend(const char* name, Communicator* comm, int rank)
      : name_(name), comm_(comm), rank_(rank) {}
  const char* Name() const override { return name_; }
  // Every collective on host memory.
  bool Enabled(const CollectiveBatch& b) const override { return b.device < 0; }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override;
  Status Allgather(CollectiveBatch& b, uint64_t tag) override;
  Status Broadcast(CollectiveBatch& b, uint64_t tag) override;
  Status Alltoall(CollectiveBatch& b, uint64_t tag) override;
  Status Reducescatter(CollectiveBatch& b, uint64_t tag) override;
  Status Barrier(CollectiveBatch& b, uint64_t tag) override;

 private:
  const char* name_;
  Communicator* comm_;
  int rank_;
  HostBuffer fusion_;
};

// Allreduce over one rank: the identity, so only the scale factors apply
// (in two passes, rounding as the other paths do), and an in-place tensor
// with no scaling costs nothing. Enabled for host allreduces of a one-rank job.
class SelfBackend : public Backend {
 public:
  explicit SelfBackend(int size) : size_(size) {}
  const char* Name() const override { return "self"; }
  bool Enabled(const CollectiveBatch& b) const override {
    return size_ == 1 && b.device < 0 && b.op == OpType::kAllreduce;
  }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override;

 private:
  int size_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_COMMUNICATOR_BACKEND_H_

// The device backend's place in the list: made by the first device batch,
// since only then is the rank's GPU known (every rank executes that batch at
// the same point of the coordinator's order, so the collective set-up lines
// up). Built without a GPU backend, the list has no device entry and the
// runtime refuses GPU tensors when they are submitted.
#include "device_backend.h"
#include "../backends.h"

namespace kerasdist::core {

namespace {

class LazyDeviceBackend : public Backend {
 public:
  explicit LazyDeviceBackend(const DeviceBackendOptions& o) : o_(o) {}
  const char* Name() const override { return impl_ ? impl_->Name() : "gpu"; }
  bool Enabled(const CollectiveBatch& b) const override {
    return b.device >= 0;
  }
  bool Asynchronous() const override { return true; }
  void Poll(std::vector<Completion>* done) override {
    if (impl_) impl_->Poll(done);
  }
  void Drain(double timeout_s, const Status& abort_status,
             std::vector<Completion>* done) override {
    if (impl_) impl_->Drain(timeout_s, abort_status, done);
  }
  bool Busy() const override { return impl_ && impl_->Busy(); }

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }
  Status Allgather(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }
  Status Broadcast(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }
  Status Alltoall(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }
  Status Reducescatter(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }
  Status Barrier(CollectiveBatch& b, uint64_t tag) override {
    return Forward(b, tag);
  }

 private:
  // A failed set-up is agreed on by all ranks (the next device batch tries
  // again), except kInternal (CUDA/NCCL), which may have hit some ranks only.
  Status Forward(CollectiveBatch& b, uint64_t tag) {
    if (!impl_) {
      DeviceBackendOptions o = o_;
      o.device = b.device;  // this rank's GPU (ranks may differ)
      Status s = RegisteredDeviceBackend().factory(o, &impl_);
      if (!s.ok()) {
        impl_.reset();
        return s;
      }
    }
    return impl_->Run(b, tag);
  }

  DeviceBackendOptions o_;
  std::unique_ptr<Backend> impl_;
};

}  // namespace

// KERASDIST_GPU_OPERATIONS. Not in the hierarchical backend's node-level
// list (device tensors never reach it).
Status MakeDeviceBackend(const Config& config, const NodeContext& ctx,
                         std::unique_ptr<Backend>* out) {
  out->reset();
  if (!RegisteredDeviceBackend().factory || ctx.within_node)
    return Status::OK();
  DeviceBackendOptions d;
  d.rank = ctx.comm->rank();
  d.size = ctx.comm->size();
  d.host_staged = config.Choice("KERASDIST_GPU_OPERATIONS") == "MPI";
  d.host = ctx.comm;
  *out = std::make_unique<LazyDeviceBackend>(d);
  return Status::OK();
}

}  // namespace kerasdist::core

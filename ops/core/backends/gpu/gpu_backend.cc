// The GPU backend: collectives on device memory through NCCL (or, with
// KERASDIST_GPU_OPERATIONS=MPI, through MPI on pinned host copies), a device
// fusion buffer and event-based completion. Compiled only with
// KERASDIST_WITH_NCCL; its last lines register it (device_backend.h).
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "device_backend.h"
#include "gpu_util.h"
#include "nccl_communicator.h"
#include "staged_communicator.h"

namespace kerasdist::core {

namespace {

class GpuBackend : public Backend {
 public:
  static Status Create(const DeviceBackendOptions& o,
                       std::unique_ptr<Backend>* out) {
    std::unique_ptr<GpuBackend> b(new GpuBackend(o));
    // Every rank sets up its device first and they agree on the outcome, so
    // that one rank's bad device fails all ranks instead of hanging them in
    // ncclCommInitRank.
    Status local = b->SetUpDevice();
    bool all_ok = false;
    KD_RETURN_IF_ERROR(AgreeAll(*o.host, local.ok(), &all_ok));
    if (!local.ok()) return local;
    if (!all_ok) {
      return Status::Internal(
          "another rank could not set up its GPU; see its log.");
    }
    if (o.host_staged) {
      b->staged_ =
          std::make_unique<HostStagedCommunicator>(o.host, b->stream_, o.rank);
      b->comm_ = b->staged_.get();
    } else {
      KD_RETURN_IF_ERROR(NcclCommunicator::Create(o, b->stream_, &b->nccl_));
      b->comm_ = b->nccl_.get();
    }
    *out = std::move(b);
    return Status::OK();
  }

  ~GpuBackend() override {
    if (stream_) {
      cudaSetDevice(o_.device);
      cudaStreamSynchronize(stream_);
    }
    nccl_.reset();
    staged_.reset();
    // The buffers and events go before the stream they are ordered on.
    fusion_.reset();
    events_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  const char* Name() const override {
    return o_.host_staged ? "mpi-staged" : "nccl";
  }
  bool Enabled(const CollectiveBatch& b) const override {
    return b.device >= 0;
  }
  bool Asynchronous() const override { return true; }
  bool Busy() const override { return !in_flight_.empty(); }
  void Poll(std::vector<Completion>* out) override;
  void Drain(double timeout_s, const Status& abort_status,
             std::vector<Completion>* out) override;

 protected:
  Status Allreduce(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunAllreduce);
  }
  Status Allgather(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunAllgather);
  }
  Status Broadcast(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunBroadcast);
  }
  Status Alltoall(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunAlltoall);
  }
  Status Reducescatter(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunReducescatter);
  }
  Status Barrier(CollectiveBatch& b, uint64_t tag) override {
    return Queue(b, tag, &GpuBackend::RunBarrier);
  }

 private:
  struct InFlight {
    uint64_t tag;
    Status status;
    cudaEvent_t done = nullptr;
  };
  using RunFn = Status (GpuBackend::*)(CollectiveBatch&);

  explicit GpuBackend(const DeviceBackendOptions& o) : o_(o) {}
  Status SetUpDevice();
  Status Queue(CollectiveBatch& b, uint64_t tag, RunFn run);
  Status WaitForInputs(const CollectiveBatch& b);
  Status RunAllreduce(CollectiveBatch& b);
  Status RunAllgather(CollectiveBatch& b);
  Status RunBroadcast(CollectiveBatch& b);
  Status RunAlltoall(CollectiveBatch& b);
  Status RunReducescatter(CollectiveBatch& b);
  Status RunBarrier(CollectiveBatch&) { return o_.host->Barrier(); }

  DeviceBackendOptions o_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> nccl_;
  std::unique_ptr<HostStagedCommunicator> staged_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<DeviceBuffer> fusion_;
  std::unique_ptr<EventPool> events_;
  std::deque<InFlight> in_flight_;
  std::chrono::steady_clock::time_point last_async_check_;
};

Status GpuBackend::SetUpDevice() {
  int count = 0;
  KD_CHECK_CUDA(cudaGetDeviceCount(&count));
  if (o_.device >= count) {
    return Status::InvalidArgument(
        "rank " + std::to_string(o_.rank) + ": the tensor is on GPU " +
        std::to_string(o_.device) + " but this process sees " +
        std::to_string(count) +
        " GPU(s); pin each rank to one GPU by its "
        "local rank.");
  }
  KD_CHECK_CUDA(cudaSetDevice(o_.device));
  // Non-blocking: the legacy default stream must not serialise with us.
  KD_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  fusion_ = std::make_unique<DeviceBuffer>();
  events_ = std::make_unique<EventPool>();
  return Status::OK();
}

// Queues `run` on the stream and an event after it. The batch is reported by
// Poll with the status of the queueing, also when that failed part-way: the
// event still marks the end of whatever was queued, so buffers are handed
// back only once the device is done with them.
Status GpuBackend::Queue(CollectiveBatch& b, uint64_t tag, RunFn run) {
  Status s = WaitForInputs(b);
  if (s.ok()) s = (this->*run)(b);
  InFlight f{tag, s, nullptr};
  Status e = events_->Get(&f.done);
  if (e.ok()) {
    cudaError_t c = cudaEventRecord(f.done, stream_);
    if (c != cudaSuccess)
      e = CudaError(c, "cudaEventRecord", __FILE__, __LINE__);
  }
  if (!e.ok()) {
    // Without an event, wait for the stream (only on this failure path);
    // the batch is then not reported by Poll.
    if (f.done) events_->Put(f.done);
    cudaStreamSynchronize(stream_);
    return e;
  }
  in_flight_.push_back(f);
  return Status::OK();
}

Status GpuBackend::WaitForInputs(const CollectiveBatch& b) {
  for (const BatchTensor& t : b.tensors) {
    if (b.device != o_.device) {
      return Status::InvalidArgument(OpTypeName(b.op) + std::string(" '") +
                                     (t.name ? *t.name : "") + "' is on GPU " +
                                     std::to_string(b.device) +
                                     ", but this rank "
                                     "already uses GPU " +
                                     std::to_string(o_.device) +
                                     "; kerasdist "
                                     "drives one GPU per process.");
    }
    // The producer's stream (TF's compute stream) must have written the
    // input before the communication stream reads it.
    if (t.ready_event) {
      KD_CHECK_CUDA(cudaStreamWaitEvent(
          stream_, static_cast<cudaEvent_t>(t.ready_event), 0));
    }
  }
  return Status::OK();
}

// The fused allreduce: copy in (with prescale) to one device buffer, one
// collective, copy out (with postscale); a single tensor skips the buffer.
Status GpuBackend::RunAllreduce(CollectiveBatch& b) {
  const int64_t esize = DataTypeSize(b.dtype);
  if (b.tensors.size() == 1) {
    BatchTensor& t = b.tensors[0];
    KD_RETURN_IF_ERROR(ScaleCopyAsync(t.output, t.input, t.count, b.dtype,
                                      b.prescale, 1, stream_));
    KD_RETURN_IF_ERROR(
        comm_->Allreduce(t.output, t.count, b.dtype, b.reduce_op));
    return ScaleCopyAsync(t.output, t.output, t.count, b.dtype, b.postscale,
                          b.divisor, stream_);
  }
  KD_RETURN_IF_ERROR(fusion_->Reserve(b.bytes(), stream_));
  char* buf = static_cast<char*>(fusion_->data());
  int64_t off = 0;
  for (const BatchTensor& t : b.tensors) {
    KD_RETURN_IF_ERROR(ScaleCopyAsync(buf + off * esize, t.input, t.count,
                                      b.dtype, b.prescale, 1, stream_));
    off += t.count;
  }
  KD_RETURN_IF_ERROR(comm_->Allreduce(buf, b.elements(), b.dtype, b.reduce_op));
  off = 0;
  for (BatchTensor& t : b.tensors) {
    KD_RETURN_IF_ERROR(ScaleCopyAsync(t.output, buf + off * esize, t.count,
                                      b.dtype, b.postscale, b.divisor,
                                      stream_));
    off += t.count;
  }
  return Status::OK();
}

// The outputs of the collectives below were allocated by the front end in
// device memory (the runtime calls its allocate before Run).
Status GpuBackend::RunBroadcast(CollectiveBatch& b) {
  BatchTensor& t = b.tensors[0];
  const int64_t bytes = t.count * DataTypeSize(b.dtype);
  if (o_.rank == b.root_rank && t.output != t.input && bytes > 0) {
    KD_CHECK_CUDA(cudaMemcpyAsync(t.output, t.input, bytes,
                                  cudaMemcpyDeviceToDevice, stream_));
  }
  return comm_->Broadcast(t.output, bytes, b.root_rank);
}

Status GpuBackend::RunAllgather(CollectiveBatch& b) {
  BatchTensor& t = b.tensors[0];
  return comm_->Allgatherv(t.input, t.output, b.recv_bytes);
}

Status GpuBackend::RunAlltoall(CollectiveBatch& b) {
  BatchTensor& t = b.tensors[0];
  return comm_->Alltoallv(t.input, b.send_bytes, t.output, b.recv_bytes);
}

Status GpuBackend::RunReducescatter(CollectiveBatch& b) {
  BatchTensor& t = b.tensors[0];
  const void* in = t.input;
  if (b.prescale != 1.0) {
    KD_RETURN_IF_ERROR(fusion_->Reserve(b.bytes(), stream_));
    KD_RETURN_IF_ERROR(ScaleCopyAsync(fusion_->data(), t.input, t.count,
                                      b.dtype, b.prescale, 1, stream_));
    in = fusion_->data();
  }
  KD_RETURN_IF_ERROR(
      comm_->Reducescatter(in, t.output, b.counts, b.dtype, b.reduce_op));
  return ScaleCopyAsync(t.output, t.output, b.counts[o_.rank], b.dtype,
                        b.postscale, b.divisor, stream_);
}

void GpuBackend::Poll(std::vector<Completion>* out) {
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    cudaError_t c = cudaEventQuery(f.done);
    if (c == cudaErrorNotReady) break;
    if (c != cudaSuccess)
      f.status = CudaError(c, "cudaEventQuery", __FILE__, __LINE__);
    events_->Put(f.done);
    out->push_back({f.tag, f.status});
    in_flight_.pop_front();
  }
  if (in_flight_.empty() || !nccl_) return;
  // A peer that went away leaves NCCL kernels spinning: look now and then.
  auto now = std::chrono::steady_clock::now();
  if (now - last_async_check_ < std::chrono::milliseconds(100)) return;
  last_async_check_ = now;
  Status s = nccl_->AsyncError();
  if (!s.ok()) Drain(0.0, s, out);
}

void GpuBackend::Drain(double timeout_s, const Status& abort_status,
                       std::vector<Completion>* out) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration<double>(timeout_s);
  while (!in_flight_.empty() && std::chrono::steady_clock::now() < deadline) {
    Poll(out);
    std::this_thread::yield();
  }
  if (in_flight_.empty()) return;
  if (nccl_) nccl_->Abort();
  cudaStreamSynchronize(stream_);
  for (InFlight& f : in_flight_) {
    events_->Put(f.done);
    out->push_back({f.tag, abort_status});
  }
  in_flight_.clear();
}

[[maybe_unused]] const bool kRegistered = [] {
  RegisteredDeviceBackend().factory = &GpuBackend::Create;
  RegisteredDeviceBackend().version =
      "NCCL " + NcclVersion() + ", CUDA " + CudaRuntimeVersion();
  return true;
}();

}  // namespace

}  // namespace kerasdist::core

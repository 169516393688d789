// KERASDIST_GPU_OPERATIONS=MPI: device buffers copied to pinned host memory,
// reduced by the MPI data plane, copied back. Compiled only with
// KERASDIST_WITH_NCCL.
#ifndef KERASDIST_CORE_BACKENDS_GPU_STAGED_COMMUNICATOR_H_
#define KERASDIST_CORE_BACKENDS_GPU_STAGED_COMMUNICATOR_H_

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../../transport/communicator.h"
#include "gpu_util.h"

namespace kerasdist::core {

// waits for the stream here (MPI is a host call); that is a stream
// synchronisation, never a device-wide one.
class HostStagedCommunicator : public Communicator {
 public:
  HostStagedCommunicator(Communicator* host, cudaStream_t stream, int rank)
      : host_(host), stream_(stream), rank_(rank) {}
  std::string Name() const override {
    return "MPI (host-staged) over " + host_->Name();
  }
  int rank() const override { return rank_; }
  int size() const override { return host_->size(); }

  Status Allreduce(void* buf, int64_t count, DataType dt,
                   ReduceOp op) override {
    const int64_t bytes = count * DataTypeSize(dt);
    KD_RETURN_IF_ERROR(Stage(&in_, bytes));
    KD_RETURN_IF_ERROR(ToHost(in_.data(), buf, bytes));
    KD_RETURN_IF_ERROR(host_->Allreduce(in_.data(), count, dt, op));
    return ToDevice(buf, in_.data(), bytes);
  }

  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override {
    int64_t total = 0;
    for (int64_t b : bytes) total += b;
    KD_RETURN_IF_ERROR(Stage(&in_, bytes[rank_]));
    KD_RETURN_IF_ERROR(Stage(&out_, total));
    KD_RETURN_IF_ERROR(ToHost(in_.data(), in, bytes[rank_]));
    KD_RETURN_IF_ERROR(host_->Allgatherv(in_.data(), out_.data(), bytes));
    return ToDevice(out, out_.data(), total);
  }

  Status Broadcast(void* buf, int64_t bytes, int root) override {
    KD_RETURN_IF_ERROR(Stage(&in_, bytes));
    if (rank_ == root) KD_RETURN_IF_ERROR(ToHost(in_.data(), buf, bytes));
    KD_RETURN_IF_ERROR(host_->Broadcast(in_.data(), bytes, root));
    return rank_ == root ? Status::OK() : ToDevice(buf, in_.data(), bytes);
  }

  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override {
    int64_t sent = 0, received = 0;
    for (int64_t b : send_bytes) sent += b;
    for (int64_t b : recv_bytes) received += b;
    KD_RETURN_IF_ERROR(Stage(&in_, sent));
    KD_RETURN_IF_ERROR(Stage(&out_, received));
    KD_RETURN_IF_ERROR(ToHost(in_.data(), in, sent));
    KD_RETURN_IF_ERROR(
        host_->Alltoallv(in_.data(), send_bytes, out_.data(), recv_bytes));
    return ToDevice(out, out_.data(), received);
  }

  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override {
    const int64_t esize = DataTypeSize(dt);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    KD_RETURN_IF_ERROR(Stage(&in_, total * esize));
    KD_RETURN_IF_ERROR(Stage(&out_, counts[rank_] * esize));
    KD_RETURN_IF_ERROR(ToHost(in_.data(), in, total * esize));
    KD_RETURN_IF_ERROR(
        host_->Reducescatter(in_.data(), out_.data(), counts, dt, op));
    return ToDevice(out, out_.data(), counts[rank_] * esize);
  }

  Status Barrier() override { return host_->Barrier(); }

 private:
  // Growing a pinned buffer frees the old one: wait for copies still using it.
  Status Stage(PinnedBuffer* b, int64_t bytes) {
    KD_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return b->Reserve(bytes);
  }
  Status ToHost(void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return Status::OK();
    KD_CHECK_CUDA(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    KD_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return Status::OK();
  }
  // Asynchronous: the pinned buffer is reused only after Stage() has waited.
  Status ToDevice(void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return Status::OK();
    KD_CHECK_CUDA(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return Status::OK();
  }

  Communicator* host_;
  cudaStream_t stream_;
  int rank_;
  PinnedBuffer in_, out_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_STAGED_COMMUNICATOR_H_

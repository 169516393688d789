// NCCL on device pointers (a Communicator whose every call only enqueues
// work on the backend's stream), and the NCCL helpers of the GPU data path.
// Compiled only with KERASDIST_WITH_NCCL.
#ifndef KERASDIST_CORE_BACKENDS_GPU_NCCL_COMMUNICATOR_H_
#define KERASDIST_CORE_BACKENDS_GPU_NCCL_COMMUNICATOR_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "../../transport/communicator.h"
#include "device_backend.h"

namespace kerasdist::core {

// "2.x.y": the NCCL this process runs with.
std::string NcclVersion();
// "NCCL error in core/backends/gpu/x.cc:42: ncclAllReduce(...): ...
// (NCCL 2.x.y)".
Status NcclError(ncclResult_t r, ncclComm_t comm, const char* call,
                 const char* file, int line);

// Inside NcclCommunicator methods `comm_` names the communicator for
// ncclGetLastError; elsewhere pass nullptr through a local named comm_.
#define KD_CHECK_NCCL(expr)                                              \
  do {                                                                   \
    ncclResult_t _kd_r = (expr);                                         \
    if (_kd_r != ncclSuccess)                                            \
      return ::kerasdist::core::NcclError(_kd_r, comm_, #expr, __FILE__, \
                                          __LINE__);                     \
  } while (0)

ncclDataType_t NcclType(DataType dt);
// OK, or why NCCL cannot reduce `dt` (it has no 16-bit integers).
Status NcclReduces(DataType dt);
ncclRedOp_t NcclOp(ReduceOp op);

namespace nccl_detail {
inline bool AllEqual(const std::vector<int64_t>& v) {
  for (int64_t x : v) {
    if (x != v[0]) return false;
  }
  return true;
}
inline char* At(void* p, int64_t off) { return static_cast<char*>(p) + off; }
inline const char* At(const void* p, int64_t off) {
  return static_cast<const char*>(p) + off;
}
}  // namespace nccl_detail

// NCCL on device pointers. Every call only enqueues work on `stream_`.
class NcclCommunicator : public Communicator {
 public:
  // Collective over `o.host`: rank 0 makes the unique id, which it
  // broadcasts.
  static Status Create(const DeviceBackendOptions& o, cudaStream_t stream,
                       std::unique_ptr<NcclCommunicator>* out);
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  std::string Name() const override { return "NCCL " + NcclVersion(); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status Allreduce(void* buf, int64_t count, DataType dt,
                   ReduceOp op) override {
    if (count == 0) return Status::OK();
    KD_RETURN_IF_ERROR(NcclReduces(dt));
    KD_CHECK_NCCL(ncclAllReduce(buf, buf, count, NcclType(dt), NcclOp(op),
                                comm_, stream_));
    return Status::OK();
  }

  // Equal parts use ncclAllGather; uneven first dimensions become one
  // ncclBroadcast per rank in a group, which NCCL runs as one launch.
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override {
    if (nccl_detail::AllEqual(bytes)) {
      if (bytes[0] == 0) return Status::OK();
      KD_CHECK_NCCL(
          ncclAllGather(in, out, bytes[0], ncclUint8, comm_, stream_));
      return Status::OK();
    }
    KD_CHECK_NCCL(ncclGroupStart());
    int64_t off = 0;
    for (int r = 0; r < size_; ++r) {
      if (bytes[r] > 0) {
        ncclResult_t res = ncclBroadcast(
            r == rank_ ? in : nccl_detail::At(out, off),
            nccl_detail::At(out, off), bytes[r], ncclUint8, r, comm_, stream_);
        if (res != ncclSuccess) {
          ncclGroupEnd();
          return NcclError(res, comm_, "ncclBroadcast", __FILE__, __LINE__);
        }
      }
      off += bytes[r];
    }
    KD_CHECK_NCCL(ncclGroupEnd());
    return Status::OK();
  }

  Status Broadcast(void* buf, int64_t bytes, int root) override {
    if (bytes == 0) return Status::OK();
    KD_CHECK_NCCL(
        ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    return Status::OK();
  }

  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override {
    KD_CHECK_NCCL(ncclGroupStart());
    int64_t soff = 0, roff = 0;
    ncclResult_t res = ncclSuccess;
    for (int r = 0; r < size_ && res == ncclSuccess; ++r) {
      if (send_bytes[r] > 0) {
        res = ncclSend(nccl_detail::At(in, soff), send_bytes[r], ncclUint8, r,
                       comm_, stream_);
      }
      if (res == ncclSuccess && recv_bytes[r] > 0) {
        res = ncclRecv(nccl_detail::At(out, roff), recv_bytes[r], ncclUint8, r,
                       comm_, stream_);
      }
      soff += send_bytes[r];
      roff += recv_bytes[r];
    }
    ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess)
      return NcclError(res, comm_, "ncclSend/ncclRecv", __FILE__, __LINE__);
    if (end != ncclSuccess)
      return NcclError(end, comm_, "ncclGroupEnd", __FILE__, __LINE__);
    return Status::OK();
  }

  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override {
    KD_RETURN_IF_ERROR(NcclReduces(dt));
    if (nccl_detail::AllEqual(counts)) {
      if (counts[0] == 0) return Status::OK();
      KD_CHECK_NCCL(ncclReduceScatter(in, out, counts[0], NcclType(dt),
                                      NcclOp(op), comm_, stream_));
      return Status::OK();
    }
    // Uneven parts: one ncclReduce per destination rank, grouped.
    const int64_t esize = DataTypeSize(dt);
    KD_CHECK_NCCL(ncclGroupStart());
    int64_t off = 0;
    ncclResult_t res = ncclSuccess;
    for (int r = 0; r < size_ && res == ncclSuccess; ++r) {
      if (counts[r] > 0) {
        res = ncclReduce(nccl_detail::At(in, off * esize), out, counts[r],
                         NcclType(dt), NcclOp(op), r, comm_, stream_);
      }
      off += counts[r];
    }
    ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess)
      return NcclError(res, comm_, "ncclReduce", __FILE__, __LINE__);
    if (end != ncclSuccess)
      return NcclError(end, comm_, "ncclGroupEnd", __FILE__, __LINE__);
    return Status::OK();
  }

  Status Barrier() override {
    return Status::Internal(
        "a device barrier is not offered; barriers run on MPI.");
  }

  // Makes NCCL kernels that wait for a dead peer return, so that the stream
  // drains; the communicator is unusable afterwards.
  void Abort() {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  // A failure NCCL detected in the background (e.g. a peer went away).
  Status AsyncError() {
    if (!comm_) return Status::OK();
    ncclResult_t async = ncclSuccess;
    KD_CHECK_NCCL(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      return NcclError(async, comm_, "ncclCommGetAsyncError", __FILE__,
                       __LINE__);
    }
    return Status::OK();
  }

 private:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int rank, int size)
      : comm_(comm), stream_(stream), rank_(rank), size_(size) {}
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_, size_;
};

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_BACKENDS_GPU_NCCL_COMMUNICATOR_H_

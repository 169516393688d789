// The GPU data path: NCCL collectives on device memory (or, with
// KERASDIST_GPU_OPERATIONS=MPI, MPI on pinned host copies), a device fusion
// buffer and event-based completion. Compiled only with KERASDIST_WITH_NCCL;
// the whole file is the backend, and its last lines register it.
#include "nccl_communicator.h"

#include "../layout.h"
#include "../scale.h"

#include <nccl.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "../runtime.h"
#include "gpu_util.h"

namespace kerasdist::core {

namespace {

std::string NcclVersion() {
  int v = 0;
  ncclGetVersion(&v);
  // NCCL >= 2.9 encodes X*10000 + Y*100 + Z.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

Status NcclError(ncclResult_t r, ncclComm_t comm, const char* call,
                 const char* file, int line) {
  std::string detail = comm ? ncclGetLastError(comm) : "";
  return Status::Internal(std::string("NCCL error in ") + file + ":" +
                          std::to_string(line) + ": " + call + ": " +
                          ncclGetErrorString(r) +
                          (detail.empty() ? "" : " (" + detail + ")") +
                          " (NCCL " + NcclVersion() + ")");
}

// Inside NcclCommunicator methods `comm_` names the communicator for
// ncclGetLastError; elsewhere pass nullptr through a local named comm_.
#define KD_CHECK_NCCL(expr)                                                 \
  do {                                                                      \
    ncclResult_t _kd_r = (expr);                                            \
    if (_kd_r != ncclSuccess)                                               \
      return NcclError(_kd_r, comm_, #expr, __FILE__, __LINE__);            \
  } while (0)

ncclDataType_t NcclType(DataType dt) {
  switch (dt) {
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kUInt8:
    case DataType::kBool: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return ncclProd;
    default: return ncclSum;  // Average arrives here as Sum (see communicator.h)
  }
}

bool AllEqual(const std::vector<int64_t>& v) {
  for (int64_t x : v) {
    if (x != v[0]) return false;
  }
  return true;
}

char* At(void* p, int64_t off) { return static_cast<char*>(p) + off; }
const char* At(const void* p, int64_t off) { return static_cast<const char*>(p) + off; }

// NCCL on device pointers. Every call only enqueues work on `stream_`.
class NcclCommunicator : public Communicator {
 public:
  // Collective over `o.comm`: rank 0 makes the unique id, MPI_Bcast shares it.
  static Status Create(const DeviceBackendOptions& o, cudaStream_t stream,
                       std::unique_ptr<NcclCommunicator>* out) {
    ncclComm_t comm_ = nullptr;
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    int ok = 1;
    Status s;
    if (o.rank == 0) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        s = NcclError(r, nullptr, "ncclGetUniqueId", __FILE__, __LINE__);
        ok = 0;
      }
    }
    int code = MPI_Bcast(&ok, 1, MPI_INT, 0, o.comm);
    if (code == MPI_SUCCESS && ok) {
      code = MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, o.comm);
    }
    if (code != MPI_SUCCESS) return MpiStatus(code, "MPI_Bcast (NCCL id)");
    if (!ok) {
      return o.rank == 0 ? s : Status::Internal("rank 0 could not create the NCCL id.");
    }
    KD_CHECK_NCCL(ncclCommInitRank(&comm_, o.size, id, o.rank));
    out->reset(new NcclCommunicator(comm_, stream, o.rank, o.size));
    return Status::OK();
  }
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  std::string Name() const override { return "NCCL " + NcclVersion(); }

  Status Allreduce(void* buf, int64_t count, DataType dt, ReduceOp op) override {
    if (count == 0) return Status::OK();
    KD_CHECK_NCCL(ncclAllReduce(buf, buf, count, NcclType(dt), NcclOp(op), comm_,
                                stream_));
    return Status::OK();
  }

  // Equal parts use ncclAllGather; uneven first dimensions become one
  // ncclBroadcast per rank in a group, which NCCL runs as one launch.
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes) override {
    if (AllEqual(bytes)) {
      if (bytes[0] == 0) return Status::OK();
      KD_CHECK_NCCL(ncclAllGather(in, out, bytes[0], ncclUint8, comm_, stream_));
      return Status::OK();
    }
    KD_CHECK_NCCL(ncclGroupStart());
    int64_t off = 0;
    for (int r = 0; r < size_; ++r) {
      if (bytes[r] > 0) {
        ncclResult_t res = ncclBroadcast(r == rank_ ? in : At(out, off),
                                         At(out, off), bytes[r], ncclUint8, r,
                                         comm_, stream_);
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
    KD_CHECK_NCCL(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    return Status::OK();
  }

  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes) override {
    KD_CHECK_NCCL(ncclGroupStart());
    int64_t soff = 0, roff = 0;
    ncclResult_t res = ncclSuccess;
    for (int r = 0; r < size_ && res == ncclSuccess; ++r) {
      if (send_bytes[r] > 0) {
        res = ncclSend(At(in, soff), send_bytes[r], ncclUint8, r, comm_, stream_);
      }
      if (res == ncclSuccess && recv_bytes[r] > 0) {
        res = ncclRecv(At(out, roff), recv_bytes[r], ncclUint8, r, comm_, stream_);
      }
      soff += send_bytes[r];
      roff += recv_bytes[r];
    }
    ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess) return NcclError(res, comm_, "ncclSend/ncclRecv", __FILE__, __LINE__);
    if (end != ncclSuccess) return NcclError(end, comm_, "ncclGroupEnd", __FILE__, __LINE__);
    return Status::OK();
  }

  Status ReduceScatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override {
    if (AllEqual(counts)) {
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
        res = ncclReduce(At(in, off * esize), out, counts[r], NcclType(dt),
                         NcclOp(op), r, comm_, stream_);
      }
      off += counts[r];
    }
    ncclResult_t end = ncclGroupEnd();
    if (res != ncclSuccess) return NcclError(res, comm_, "ncclReduce", __FILE__, __LINE__);
    if (end != ncclSuccess) return NcclError(end, comm_, "ncclGroupEnd", __FILE__, __LINE__);
    return Status::OK();
  }

  Status Barrier() override {
    return Status::Internal("a device barrier is not offered; barriers run on MPI.");
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
      return NcclError(async, comm_, "ncclCommGetAsyncError", __FILE__, __LINE__);
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

// KERASDIST_GPU_OPERATIONS=MPI: device buffers copied to pinned host memory,
// reduced by the MPI data plane, copied back. Needed where NCCL cannot run
// (two ranks on one GPU) and useful to compare against. The background thread
// waits for the stream here (MPI is a host call); that is a stream
// synchronisation, never a device-wide one.
class HostStagedCommunicator : public Communicator {
 public:
  HostStagedCommunicator(Communicator* host, cudaStream_t stream, int rank)
      : host_(host), stream_(stream), rank_(rank) {}
  std::string Name() const override { return "MPI (host-staged) over " + host_->Name(); }

  Status Allreduce(void* buf, int64_t count, DataType dt, ReduceOp op) override {
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
    KD_RETURN_IF_ERROR(host_->Alltoallv(in_.data(), send_bytes, out_.data(), recv_bytes));
    return ToDevice(out, out_.data(), received);
  }

  Status ReduceScatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dt,
                       ReduceOp op) override {
    const int64_t esize = DataTypeSize(dt);
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    KD_RETURN_IF_ERROR(Stage(&in_, total * esize));
    KD_RETURN_IF_ERROR(Stage(&out_, counts[rank_] * esize));
    KD_RETURN_IF_ERROR(ToHost(in_.data(), in, total * esize));
    KD_RETURN_IF_ERROR(host_->ReduceScatter(in_.data(), out_.data(), counts, dt, op));
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
    KD_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    KD_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return Status::OK();
  }
  // Asynchronous: the pinned buffer is reused only after Stage() has waited.
  Status ToDevice(void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return Status::OK();
    KD_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return Status::OK();
  }

  Communicator* host_;
  cudaStream_t stream_;
  int rank_;
  PinnedBuffer in_, out_;
};

// Average as Sum plus scaling, exactly as on the host path (scale.h).
Scaling AverageAsSum(const Request& q, int size) {
  return AverageAsSum(q.reduce_op, q.dtype, q.postscale, size);
}

class GpuBackend : public DeviceBackend {
 public:
  static Status Create(const DeviceBackendOptions& o,
                       std::unique_ptr<DeviceBackend>* out) {
    std::unique_ptr<GpuBackend> b(new GpuBackend(o));
    // Every rank sets up its device first and they agree on the outcome, so
    // that one rank's bad device fails all ranks instead of hanging them in
    // ncclCommInitRank.
    Status local = b->SetUpDevice();
    int ok = local.ok() ? 1 : 0, all_ok = 0;
    int code = MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, o.comm);
    if (code != MPI_SUCCESS) return MpiStatus(code, "MPI_Allreduce (GPU setup)");
    if (!local.ok()) return local;
    if (!all_ok) {
      return Status::Internal("another rank could not set up its GPU; see its log.");
    }
    if (o.host_staged) {
      b->staged_ = std::make_unique<HostStagedCommunicator>(o.host, b->stream_, o.rank);
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

  std::string Name() const override { return comm_->Name(); }

  Status Execute(const std::vector<const Response*>& resps,
                 std::vector<Entry> entries) override {
    Batch b;
    b.entries = std::move(entries);
    b.results.resize(b.entries.size());
    Status s = Enqueue(resps, &b);
    for (Result& r : b.results) r.status = s;
    // The event still marks the end of whatever was queued, so that buffers
    // are handed back only once the device is done with them.
    Status e = events_->Get(&b.done);
    if (e.ok()) {
      cudaError_t c = cudaEventRecord(b.done, stream_);
      if (c != cudaSuccess) e = CudaError(c, "cudaEventRecord", __FILE__, __LINE__);
    }
    if (!e.ok()) {
      // Without an event, wait for the stream (only on this failure path).
      cudaStreamSynchronize(stream_);
      b.done = nullptr;
      for (Result& r : b.results) r.status = e;
    }
    in_flight_.push_back(std::move(b));
    if (!e.ok()) return e;
    return s.code() == StatusCode::kInternal ? s : Status::OK();
  }

  void Poll(FinishedEntries* out) override {
    while (!in_flight_.empty()) {
      Batch& b = in_flight_.front();
      if (b.done) {
        cudaError_t c = cudaEventQuery(b.done);
        if (c == cudaErrorNotReady) break;
        if (c != cudaSuccess) {
          Status s = CudaError(c, "cudaEventQuery", __FILE__, __LINE__);
          for (Result& r : b.results) r.status = s;
        }
        events_->Put(b.done);
      }
      for (size_t i = 0; i < b.entries.size(); ++i) {
        out->emplace_back(std::move(b.entries[i]), std::move(b.results[i]));
      }
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

  void Drain(double timeout_s, const Status& abort_status,
             FinishedEntries* out) override {
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration<double>(timeout_s);
    while (!in_flight_.empty() && std::chrono::steady_clock::now() < deadline) {
      Poll(out);
      std::this_thread::yield();
    }
    if (in_flight_.empty()) return;
    if (nccl_) nccl_->Abort();
    cudaStreamSynchronize(stream_);
    for (Batch& b : in_flight_) {
      if (b.done) events_->Put(b.done);
      for (Entry& e : b.entries) out->emplace_back(std::move(e), Result{abort_status, {}});
    }
    in_flight_.clear();
  }

  bool Busy() const override { return !in_flight_.empty(); }

 private:
  struct Batch {
    std::vector<Entry> entries;
    std::vector<Result> results;
    cudaEvent_t done = nullptr;
  };

  explicit GpuBackend(const DeviceBackendOptions& o) : o_(o) {}

  Status SetUpDevice() {
    int count = 0;
    KD_CHECK_CUDA(cudaGetDeviceCount(&count));
    if (o_.device >= count) {
      return Status::InvalidArgument(
          "rank " + std::to_string(o_.rank) + ": the tensor is on GPU " +
          std::to_string(o_.device) + " but this process sees " +
          std::to_string(count) + " GPU(s); pin each rank to one GPU by its "
          "local rank.");
    }
    KD_CHECK_CUDA(cudaSetDevice(o_.device));
    // Non-blocking: the legacy default stream must not serialise with us.
    KD_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    fusion_ = std::make_unique<DeviceBuffer>();
    events_ = std::make_unique<EventPool>();
    return Status::OK();
  }

  Status Enqueue(const std::vector<const Response*>& resps, Batch* b) {
    for (Entry& e : b->entries) {
      if (e.req.device != o_.device) {
        return Status::InvalidArgument(
            OpTypeName(e.req.op) + std::string(" '") + e.req.name +
            "' is on GPU " + std::to_string(e.req.device) + ", but this rank "
            "already uses GPU " + std::to_string(o_.device) + "; kerasdist "
            "drives one GPU per process.");
      }
      // The producer's stream (TF's compute stream) must have written the
      // input before the communication stream reads it.
      if (e.ready_event) {
        KD_CHECK_CUDA(cudaStreamWaitEvent(
            stream_, static_cast<cudaEvent_t>(e.ready_event), 0));
      }
    }
    const Response& head = *resps[0];
    if (head.req.op == OpType::kAllreduce) return Allreduce(b->entries);
    return Other(head, b->entries[0], &b->results[0]);
  }

  // The fused allreduce: copy in (with prescale) to one device buffer, one
  // collective, copy out (with postscale); a single tensor skips the buffer.
  Status Allreduce(std::vector<Entry>& entries) {
    const Request& q = entries[0].req;
    const Scaling sc = AverageAsSum(q, o_.size);
    const int64_t esize = DataTypeSize(q.dtype);
    if (entries.size() == 1) {
      Entry& e = entries[0];
      const int64_t n = NumElements(e.req.shape);
      KD_RETURN_IF_ERROR(ScaleCopyAsync(e.output, e.input, n, q.dtype, q.prescale, 1, stream_));
      KD_RETURN_IF_ERROR(comm_->Allreduce(e.output, n, q.dtype, sc.op));
      return ScaleCopyAsync(e.output, e.output, n, q.dtype, sc.post, sc.divisor, stream_);
    }
    int64_t total = 0;
    for (Entry& e : entries) total += NumElements(e.req.shape);
    KD_RETURN_IF_ERROR(fusion_->Reserve(total * esize, stream_));
    char* buf = static_cast<char*>(fusion_->data());
    int64_t off = 0;
    for (Entry& e : entries) {
      const int64_t n = NumElements(e.req.shape);
      KD_RETURN_IF_ERROR(ScaleCopyAsync(buf + off * esize, e.input, n, q.dtype,
                                        q.prescale, 1, stream_));
      off += n;
    }
    KD_RETURN_IF_ERROR(comm_->Allreduce(buf, total, q.dtype, sc.op));
    off = 0;
    for (Entry& e : entries) {
      const int64_t n = NumElements(e.req.shape);
      KD_RETURN_IF_ERROR(ScaleCopyAsync(e.output, buf + off * esize, n, q.dtype,
                                        sc.post, sc.divisor, stream_));
      off += n;
    }
    return Status::OK();
  }

  // Mirrors Runtime::RunOther for device memory. `allocate` must hand back
  // device memory (the C API requires a preallocated output for device
  // tensors; a TF kernel will allocate with TF's GPU allocator).
  Status Other(const Response& resp, Entry& e, Result* result) {
    const Request& q = e.req;
    const int64_t esize = DataTypeSize(q.dtype);
    switch (q.op) {
      case OpType::kBroadcast: {
        const int64_t bytes = NumElements(q.shape) * esize;
        if (o_.rank == q.root_rank && e.output != e.input && bytes > 0) {
          KD_CHECK_CUDA(cudaMemcpyAsync(e.output, e.input, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
        }
        return comm_->Broadcast(e.output, bytes, q.root_rank);
      }
      case OpType::kAllgather: {
        const Layout l = AllgatherLayout(resp, q);
        void* out = nullptr;
        KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
        return comm_->Allgatherv(e.input, out, l.recv_bytes);
      }
      case OpType::kAlltoall: {
        Layout l = AlltoallLayout(resp, q, o_.rank, o_.size);
        void* out = nullptr;
        KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
        result->recv_splits = std::move(l.recv_splits);
        return comm_->Alltoallv(e.input, l.send_bytes, out, l.recv_bytes);
      }
      case OpType::kReducescatter: {
        const Scaling sc = AverageAsSum(q, o_.size);
        const Layout l = ReducescatterLayout(q, o_.rank, o_.size);
        const std::vector<int64_t>& counts = l.counts;
        void* out = nullptr;
        KD_RETURN_IF_ERROR(e.allocate(l.out_shape, &out));
        const void* in = e.input;
        const int64_t total = NumElements(q.shape);
        if (q.prescale != 1.0) {
          KD_RETURN_IF_ERROR(fusion_->Reserve(total * esize, stream_));
          KD_RETURN_IF_ERROR(ScaleCopyAsync(fusion_->data(), e.input, total,
                                            q.dtype, q.prescale, 1, stream_));
          in = fusion_->data();
        }
        KD_RETURN_IF_ERROR(comm_->ReduceScatter(in, out, counts, q.dtype, sc.op));
        return ScaleCopyAsync(out, out, counts[o_.rank], q.dtype, sc.post,
                              sc.divisor, stream_);
      }
      case OpType::kBarrier:
        return o_.host->Barrier();
      case OpType::kAllreduce:
        break;
    }
    return Status::Internal("unexpected device operation (kerasdist bug)");
  }

  DeviceBackendOptions o_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> nccl_;
  std::unique_ptr<HostStagedCommunicator> staged_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<DeviceBuffer> fusion_;
  std::unique_ptr<EventPool> events_;
  std::deque<Batch> in_flight_;
  std::chrono::steady_clock::time_point last_async_check_;
};

// Events for front ends (DeviceStreamHooks): any thread may record or
// release one, so the pools (one per device: an event belongs to the device
// it was made on) have their own lock.
std::mutex front_events_mu;
std::map<int, std::vector<cudaEvent_t>> front_events;

// Makes `device` current on this thread for its lifetime, then restores the
// thread's previous device (a framework thread may expect its own).
class OnDevice {
 public:
  explicit OnDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
  }
  ~OnDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

Status RecordFrontEvent(void* stream, int device, void** event) {
  OnDevice on(device);
  KD_CHECK_CUDA(on.status());
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> l(front_events_mu);
    std::vector<cudaEvent_t>& pool = front_events[device];
    if (!pool.empty()) {
      e = pool.back();
      pool.pop_back();
    }
  }
  if (e == nullptr) KD_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(stream));
  if (r != cudaSuccess) {
    cudaEventDestroy(e);
    return CudaError(r, "cudaEventRecord(event, framework stream)", __FILE__, __LINE__);
  }
  *event = e;
  return Status::OK();
}

void ReleaseFrontEvent(void* event, int device) {
  if (event == nullptr) return;
  std::lock_guard<std::mutex> l(front_events_mu);
  front_events[device].push_back(static_cast<cudaEvent_t>(event));
}

Status SyncFrontStream(void* stream, int device) {
  OnDevice on(device);
  KD_CHECK_CUDA(on.status());
  KD_CHECK_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::OK();
}

[[maybe_unused]] const bool kRegistered = [] {
  RegisteredDeviceBackend().factory = &GpuBackend::Create;
  RegisteredDeviceBackend().hooks = {&RecordFrontEvent, &ReleaseFrontEvent,
                                     &SyncFrontStream};
  RegisteredDeviceBackend().version =
      "NCCL " + NcclVersion() + ", CUDA " + CudaRuntimeVersion();
  return true;
}();

}  // namespace

}  // namespace kerasdist::core

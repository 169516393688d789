// AsyncOpKernels: each describes its tensors as the core's C API takes them
// (c_api.h, the one seam of every front end), enqueues them and returns; the
// core's background thread completes the op through the C callbacks below.
//
// Built with KERASDIST_TF_GPU (the core has its NCCL backend), the same
// kernels are also registered for GPUs. There the tensors stay in device
// memory: each request carries the CUDA ordinal of TF's stream and an event
// recorded on that stream once the op's outputs are allocated, so the
// communication stream starts only after TF has written the inputs and
// stopped using the outputs' memory (TF's allocator reuses memory in its own
// stream's order). The op completes when the backend has seen the work
// finish on the device; nothing waits for the whole device. Outputs whose
// size only negotiation knows (allgather, alltoall, reducescatter) are
// allocated by TF through the C API's allocate callback, on the background
// thread, after the event (so the collective writes TF's own tensor, no copy
// between): there the thread waits for TF's stream once before the
// collective may write them.
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/c_api.h"
#include "../core/device_hooks.h"
#include "../core/host_buffer.h"
#include "../core/types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#ifdef KERASDIST_TF_GPU
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"
#endif

namespace kerasdist::tf {

namespace core = ::kerasdist::core;
using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

namespace {

// The core's StatusCode `code` (as the C API gives it) and its message as
// TF's error.
::tensorflow::Status ToTf(int32_t code, const std::string& message) {
  namespace errors = ::tensorflow::errors;
  switch (static_cast<core::StatusCode>(code)) {
    case core::StatusCode::kOk:
      return ::tensorflow::Status();
    case core::StatusCode::kInvalidArgument:
      return errors::InvalidArgument(message);
    // Ranks that disagree about a tensor: Horovod's error type.
    case core::StatusCode::kMismatch:
    case core::StatusCode::kPrecondition:
      return errors::FailedPrecondition(message);
    case core::StatusCode::kAborted:
      return errors::Aborted(message);
    case core::StatusCode::kInternal:
      return errors::Internal(message);
    // Horovod's TF elastic `run` takes UnknownError of its ops as an
    // internal error (kerasdist/elastic.py _ranks_lost reads the text).
    case core::StatusCode::kRanksLost:
      return errors::Unknown(message);
  }
  return errors::Unknown(message);
}

::tensorflow::Status ToTf(const core::Status& s) {
  return ToTf(static_cast<int32_t>(s.code()), s.message());
}

bool ToCore(::tensorflow::DataType dt, core::DataType* out) {
  switch (dt) {
    case ::tensorflow::DT_HALF:
      *out = core::DataType::kFloat16;
      return true;
    case ::tensorflow::DT_BFLOAT16:
      *out = core::DataType::kBFloat16;
      return true;
    case ::tensorflow::DT_FLOAT:
      *out = core::DataType::kFloat32;
      return true;
    case ::tensorflow::DT_DOUBLE:
      *out = core::DataType::kFloat64;
      return true;
    case ::tensorflow::DT_INT32:
      *out = core::DataType::kInt32;
      return true;
    case ::tensorflow::DT_INT64:
      *out = core::DataType::kInt64;
      return true;
    case ::tensorflow::DT_UINT8:
      *out = core::DataType::kUInt8;
      return true;
    case ::tensorflow::DT_BOOL:
      *out = core::DataType::kBool;
      return true;
    case ::tensorflow::DT_INT8:
      *out = core::DataType::kInt8;
      return true;
    case ::tensorflow::DT_INT16:
      *out = core::DataType::kInt16;
      return true;
    case ::tensorflow::DT_UINT16:
      *out = core::DataType::kUInt16;
      return true;
    default:
      return false;
  }
}

std::vector<int64_t> Dims(const TensorShape& s) {
  std::vector<int64_t> d;
  for (int i = 0; i < s.dims(); ++i) d.push_back(s.dim_size(i));
  return d;
}

void* Data(const Tensor& t) {
  return const_cast<char*>(t.tensor_data().data());
}

// Where a kernel's tensors live: host memory (device -1), or GPU `device`
// with TF's compute stream (a cudaStream_t).
struct Placement {
  int device = -1;
  void* stream = nullptr;
};

::tensorflow::Status GetPlacement(OpKernelContext* ctx, bool on_gpu,
                                  Placement* p) {
  *p = Placement();
  if (!on_gpu) return ::tensorflow::Status();
#ifdef KERASDIST_TF_GPU
  if (core::DeviceHooks() == nullptr) {
    return ::tensorflow::errors::FailedPrecondition(
        "kerasdist: this library was built without its GPU backend; rebuild "
        "with CUDA and NCCL (KERASDIST_WITH_NCCL=1).");
  }
  auto* dc = ctx->op_device_context();
  auto* stream = dc != nullptr ? dc->stream() : nullptr;
  if (stream == nullptr ||
      stream->platform_specific_handle().stream == nullptr) {
    return ::tensorflow::errors::Internal(
        "kerasdist: TensorFlow gave this GPU kernel no CUDA stream.");
  }
  p->stream = stream->platform_specific_handle().stream;
  p->device = stream->parent()->device_ordinal();
  return ::tensorflow::Status();
#else
  (void)ctx;
  return ::tensorflow::errors::Internal(
      "kerasdist: GPU kernel in a CPU-only build.");
#endif
}

// For a GPU placement: an event on TF's stream after everything queued there
// so far. *event stays null for host memory.
::tensorflow::Status RecordReady(const Placement& p, void** event) {
  *event = nullptr;
  if (p.device < 0) return ::tensorflow::Status();
#ifdef KERASDIST_TF_GPU
  return ToTf(core::DeviceHooks()->record_event(p.stream, p.device, event));
#else
  return ::tensorflow::errors::Internal(
      "kerasdist: GPU kernel in a CPU-only build.");
#endif
}

void ReleaseReady(void* event, int device) {
#ifdef KERASDIST_TF_GPU
  if (event != nullptr) core::DeviceHooks()->release_event(event, device);
#else
  (void)event;
  (void)device;
#endif
}

// The output of an op whose result has the input's shape: the input's buffer
// when TF lets us take it over, else a buffer this kernel allocated before and
// nobody else holds any more, else a new one. Reusing the buffer spares a
// fresh allocation per call, which for large tensors means page-faulting
// every page again (about 5 ms per 64 MiB here). A kernel's first call keeps
// nothing: an eager op called once under a name of its own (the broadcast of
// each variable at the start of training) has a kernel of its own, which TF
// keeps for good, and a cached buffer would keep a whole copy of the variable
// resident with it. Kernels called again (a graph's, an eager loop's) cache
// from their second call on.
class OutputCache {
 public:
  explicit OutputCache(bool on_gpu = false) : on_gpu_(on_gpu) {}

  ::tensorflow::Status Get(OpKernelContext* ctx, int index, Tensor** out) {
    const Tensor& in = ctx->input(index);
    std::unique_ptr<Tensor> forwarded = ctx->forward_input(
        index, index, in.dtype(), in.shape(), ::tensorflow::DEVICE_MEMORY,
        ::tensorflow::AllocatorAttributes());
    if (forwarded != nullptr) {
      ctx->set_output(index, *forwarded);
      *out = ctx->mutable_output(index);
      return ::tensorflow::Status();
    }
    std::lock_guard<std::mutex> l(mu_);
    if (cached_.size() <= static_cast<size_t>(index)) {
      cached_.resize(index + 1);
      next_.resize(index + 1, 0);
      called_.resize(index + 1, false);
    }
    if (!called_[index]) {
      called_[index] = true;
      return ctx->allocate_output(index, in.shape(), out);
    }
    // Two buffers per output: a caller that keeps the previous result while
    // it makes the next call (`last = f(x)` in a loop) still gets reuse.
    auto& slots = cached_[index];
    Tensor* c = nullptr;
    for (Tensor& t : slots) {
      if (t.IsInitialized() && t.dtype() == in.dtype() &&
          t.shape() == in.shape() && t.RefCountIsOne()) {
        c = &t;
        break;
      }
    }
    if (c == nullptr) {
      c = &slots[next_[index]];
      next_[index] ^= 1;
      TF_RETURN_IF_ERROR(ctx->allocate_temp(in.dtype(), in.shape(), c));
      // This buffer will be reused: back it by huge pages where the kernel
      // allows, as numpy does for its large arrays.
      if (!on_gpu_) core::AdviseHugePages(Data(*c), c->TotalBytes());
    }
    ctx->set_output(index, *c);
    *out = ctx->mutable_output(index);
    return ::tensorflow::Status();
  }

 private:
  const bool on_gpu_;
  std::mutex mu_;
  std::vector<std::array<Tensor, 2>> cached_;
  std::vector<int> next_;
  std::vector<bool> called_;
};

// The attributes every reducing op has (allreduce, grouped allreduce,
// reducescatter), read once when the kernel is built.
struct ReduceAttrs {
  int reduce_op = 0;
  float prescale = 1.0f, postscale = 1.0f;

  ::tensorflow::Status Read(OpKernelConstruction* c) {
    TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", &reduce_op));
    TF_RETURN_IF_ERROR(c->GetAttr("prescale_factor", &prescale));
    return c->GetAttr("postscale_factor", &postscale);
  }
  void Apply(kerasdist_request* req) const {
    req->reduce_op = reduce_op;
    req->prescale = prescale;
    req->postscale = postscale;
  }
};

// The request for `in` (absent: an op without tensors) named `name`; `name`
// and `dims` must outlive it.
kerasdist_request MakeRequest(core::OpType op, const std::string& name,
                              core::DataType dtype,
                              const std::vector<int64_t>& dims, int process_set,
                              int device) {
  kerasdist_request r{};
  r.name = name.c_str();
  r.op = static_cast<int32_t>(op);
  r.reduce_op = static_cast<int32_t>(core::ReduceOp::kSum);
  r.dtype = static_cast<int32_t>(dtype);
  r.ndim = static_cast<int32_t>(dims.size());
  r.shape = dims.data();
  r.prescale = 1.0;
  r.postscale = 1.0;
  r.device = device;
  r.process_set = process_set;
  return r;
}

// One single-tensor op in flight: what the core's callbacks need. Owned by
// the core from a successful enqueue until OpDone, which deletes it.
struct OpCall {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  Placement where;
  void* ready = nullptr;  // the GPU ready event, released when done
  bool alltoall = false;  // outputs the received splits too
  std::string error;      // an allocation failure, for the core to copy
};

// Completes the op: its error, or for alltoall the received splits.
void Complete(OpCall& c, int32_t status, const char* message, int32_t nsplits,
              const int64_t* recv_splits) {
  ReleaseReady(c.ready, c.where.device);
  if (status != 0) {
    c.ctx->SetStatus(ToTf(status, message));
  } else if (c.alltoall) {
    Tensor* out = nullptr;
    ::tensorflow::Status s =
        c.ctx->allocate_output(1, TensorShape({int64_t{nsplits}}), &out);
    if (s.ok()) {
      auto o = out->flat<int64_t>();
      for (int32_t i = 0; i < nsplits; ++i) o(i) = recv_splits[i];
    } else {
      c.ctx->SetStatus(s);
    }
  }
  c.done();
}

// kerasdist_done_fn of a single-tensor op.
void OpDone(void* arg, const kerasdist_result* r) {
  std::unique_ptr<OpCall> c(static_cast<OpCall*>(arg));
  Complete(*c, r->status, r->message, r->nsplits, r->recv_splits);
}

// kerasdist_allocate_fn: TF allocates output 0 once negotiation knows its
// shape, and the collective writes it in place. On a GPU the memory TF hands
// out may still be in use by work queued on its stream after the ready
// event, so the (background) thread waits for that stream first.
int32_t AllocateOutput(void* arg, int32_t ndim, const int64_t* dims,
                       void** data, const char** message) {
  OpCall& c = *static_cast<OpCall*>(arg);
  TensorShape shape;
  for (int32_t i = 0; i < ndim; ++i) shape.AddDim(dims[i]);
  Tensor* out = nullptr;
  ::tensorflow::Status s = c.ctx->allocate_output(0, shape, &out);
  if (!s.ok()) {
    c.error = "could not allocate the output: " + std::string(s.message());
    *message = c.error.c_str();
    return static_cast<int32_t>(core::StatusCode::kInternal);
  }
#ifdef KERASDIST_TF_GPU
  if (c.where.device >= 0) {
    core::Status synced =
        core::DeviceHooks()->sync_stream(c.where.stream, c.where.device);
    if (!synced.ok()) {
      c.error = synced.message();
      *message = c.error.c_str();
      return static_cast<int32_t>(synced.code());
    }
  }
#endif
  *data = Data(*out);
  return 0;
}

// A failure before the op reached the core: "not initialized" comes first,
// as the op could not have run anyway.
::tensorflow::Status EarlyFailure(const ::tensorflow::Status& s) {
  if (s.ok() || kerasdist_is_initialized()) return s;
  return ::tensorflow::errors::FailedPrecondition(
      "kerasdist is not initialized; call kerasdist.init() first.");
}

// Shared by every single-tensor kernel: the tensor name (attr, else the node
// name), the request from the op's input and the enqueue with its errors.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c)
      : AsyncOpKernel(c),
        on_gpu_(c->device_type() == ::tensorflow::DEVICE_GPU) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
  }

  // See GroupedAllreduceOp::IsExpensive.
  bool IsExpensive() override { return false; }

 protected:
  // Where the op runs and its request for input 0 (if any) into *r; *dims
  // holds the shape *r points to. False (the op failed) on an error.
  bool Begin(OpKernelContext* ctx, DoneCallback& done, core::OpType op,
             std::vector<int64_t>* dims, kerasdist_request* r,
             Placement* where) {
    ::tensorflow::Status placed = GetPlacement(ctx, on_gpu_, where);
    if (!placed.ok()) {
      ctx->SetStatus(EarlyFailure(placed));
      done();
      return false;
    }
    core::DataType dtype = core::DataType::kUInt8;
    if (ctx->num_inputs() > 0) {
      const Tensor& in = ctx->input(0);
      if (!ToCore(in.dtype(), &dtype)) {
        ctx->SetStatus(EarlyFailure(::tensorflow::errors::InvalidArgument(
            "kerasdist: unsupported dtype ",
            ::tensorflow::DataTypeString(in.dtype()), " for '", tensor_name_,
            "'.")));
        done();
        return false;
      }
      *dims = Dims(in.shape());
    }
    *r = MakeRequest(op, tensor_name_, dtype, *dims, process_set_,
                     where->device);
    return true;
  }

  // Call once the op's own outputs are allocated (on a GPU the ready event
  // is recorded here). `output` null: AllocateOutput provides output 0.
  void Submit(OpKernelContext* ctx, DoneCallback done,
              const kerasdist_request& r, void* output, const Placement& where,
              bool alltoall = false) {
    void* ready = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, RecordReady(where, &ready), done);
    auto* c = new OpCall{ctx, std::move(done), where, ready, alltoall, {}};
    const void* input =
        ctx->num_inputs() > 0 ? ctx->input(0).tensor_data().data() : nullptr;
    kerasdist_tensor t{&r,
                       input,
                       output,
                       ready,
                       output == nullptr ? &AllocateOutput : nullptr,
                       &OpDone,
                       c};
    const int code = kerasdist_enqueue_tensors(&t, 1, nullptr);
    // Not queued: the core will not call back; end the op here.
    if (code != 0) {
      std::unique_ptr<OpCall> own(c);
      Complete(*own, code, kerasdist_last_error(), 0, nullptr);
    }
  }

  const bool on_gpu_;
  std::string tensor_name_;
  int process_set_ = 0;
};

class AllreduceOp : public CollectiveKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, reduce_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("group", &group_));
    OP_REQUIRES_OK(c, c->GetAttr("group_size", &group_size_));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAllreduce, &dims, &r, &where)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, outputs_.Get(ctx, 0, &out), done);
    reduce_.Apply(&r);
    r.group = group_.c_str();
    r.group_size = group_size_;
    Submit(ctx, std::move(done), r, Data(*out), where);
  }

 private:
  ReduceAttrs reduce_;
  std::string group_;
  int group_size_;
  OutputCache outputs_{on_gpu_};
};

class GroupedAllreduceOp : public AsyncOpKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction* c)
      : AsyncOpKernel(c),
        on_gpu_(c->device_type() == ::tensorflow::DEVICE_GPU),
        outputs_(on_gpu_) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &base_));
    if (base_.empty()) base_ = name();
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
    OP_REQUIRES_OK(c, reduce_.Read(c));
    // "<base>.<i>" for every member, built once: a node's input count is fixed.
    for (int i = 0; i < c->num_inputs(); ++i) {
      names_.push_back(base_ + "." + std::to_string(i));
    }
  }

  // ComputeAsync only enqueues, so TF's executor may run it inline, on the
  // thread that made its inputs, as soon as they exist. An AsyncOpKernel
  // is never timed (TF's cost estimates come from synchronous kernels), so
  // it would otherwise count as expensive for ever and be handed to the
  // inter-op pool, whose worker takes its own queue's newest task first: with
  // one inter-op thread, a gradient bucket's allreduce then waited behind
  // the whole rest of backprop, and overlapped nothing.
  bool IsExpensive() override { return false; }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int n = ctx->num_inputs();
    if (n == 0) {
      OP_REQUIRES_ASYNC(
          ctx, kerasdist_is_initialized() != 0,
          ::tensorflow::errors::FailedPrecondition(
              "kerasdist is not initialized; call kerasdist.init() first."),
          done);
      done();
      return;
    }
    Placement where;
    OP_REQUIRES_OK_ASYNC(ctx, EarlyFailure(GetPlacement(ctx, on_gpu_, &where)),
                         done);
    Members m(n);
    // A failure here fails the op before anything is enqueued.
    OP_REQUIRES_OK_ASYNC(ctx, EarlyFailure(MakeMembers(ctx, where, &m)), done);
    // Every output is allocated: the ready point for the whole group.
    void* ready = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, RecordReady(where, &ready), done);
    // The members' callbacks share this one object (no allocation per
    // member); the op's own `done` is moved here once.
    auto* count = new Countdown(ctx, std::move(done), n, ready, where.device);
    for (kerasdist_tensor& t : m.tensors) {
      t.ready_event = ready;
      t.arg = count;
    }
    int32_t queued = 0;
    const int code = kerasdist_enqueue_tensors(m.tensors.data(), n, &queued);
    if (queued == n) return;
    const std::string message = kerasdist_last_error();
    for (int i = queued; i < n; ++i) count->Finish(code, message.c_str());
  }

 private:
  // Completes the op when the last member finishes, then deletes itself;
  // keeps the first error. On a GPU the members share one ready event,
  // released with the last.
  class Countdown {
   public:
    Countdown(OpKernelContext* ctx, DoneCallback done, int n, void* ready,
              int device)
        : ctx_(ctx),
          done_(std::move(done)),
          left_(n),
          ready_(ready),
          device_(device) {}

    // kerasdist_done_fn of every member.
    static void Done(void* arg, const kerasdist_result* r) {
      static_cast<Countdown*>(arg)->Finish(r->status, r->message);
    }

    void Finish(int32_t status, const char* message) {
      if (status != 0) {
        std::lock_guard<std::mutex> l(mu_);
        if (first_code_ == 0) {
          first_code_ = status;
          first_message_ = message;
        }
      }
      if (--left_ != 0) return;
      ReleaseReady(ready_, device_);
      if (first_code_ != 0) ctx_->SetStatus(ToTf(first_code_, first_message_));
      DoneCallback done = std::move(done_);
      delete this;
      done();
    }

   private:
    OpKernelContext* const ctx_;
    DoneCallback done_;
    std::atomic<int> left_;
    std::mutex mu_;
    int32_t first_code_ = 0;
    std::string first_message_;
    void* const ready_;
    const int device_;
  };

  // The members' requests and what they point to.
  struct Members {
    explicit Members(int n) : dims(n), requests(n), tensors(n) {}
    std::vector<std::vector<int64_t>> dims;
    std::vector<kerasdist_request> requests;
    std::vector<kerasdist_tensor> tensors;
  };

  // One tensor per input, its output allocated; the callbacks' `arg` is left
  // to the caller.
  ::tensorflow::Status MakeMembers(OpKernelContext* ctx, const Placement& where,
                                   Members* m) {
    const int n = static_cast<int>(m->tensors.size());
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(outputs_.Get(ctx, i, &out));
      core::DataType dtype;
      if (!ToCore(in.dtype(), &dtype)) {
        return ::tensorflow::errors::InvalidArgument(
            "kerasdist: unsupported dtype ",
            ::tensorflow::DataTypeString(in.dtype()));
      }
      m->dims[i] = Dims(in.shape());
      kerasdist_request& r = m->requests[i];
      r = MakeRequest(core::OpType::kAllreduce, names_[i], dtype, m->dims[i],
                      process_set_, where.device);
      reduce_.Apply(&r);
      r.group = base_.c_str();
      r.group_size = n;
      m->tensors[i] = {&r,      in.tensor_data().data(), Data(*out), nullptr,
                       nullptr, &Countdown::Done,        nullptr};
    }
    return ::tensorflow::Status();
  }

  const bool on_gpu_;
  std::string base_;
  int process_set_ = 0;
  ReduceAttrs reduce_;
  OutputCache outputs_;
  std::vector<std::string> names_;
};

class AllgatherOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAllgather, &dims, &r, &where)) return;
    Submit(ctx, std::move(done), r, nullptr, where);
  }
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kBroadcast, &dims, &r, &where)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, outputs_.Get(ctx, 0, &out), done);
    r.root_rank = root_rank_;
    Submit(ctx, std::move(done), r, Data(*out), where);
  }

 private:
  int root_rank_;
  OutputCache outputs_{on_gpu_};
};

class AlltoallOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAlltoall, &dims, &r, &where)) return;
    auto splits = ctx->input(1).flat<int64_t>();
    r.nsplits = static_cast<int32_t>(splits.size());
    r.splits = splits.data();
    Submit(ctx, std::move(done), r, nullptr, where, /*alltoall=*/true);
  }
};

class ReducescatterOp : public CollectiveKernel {
 public:
  explicit ReducescatterOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, reduce_.Read(c));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kReducescatter, &dims, &r, &where))
      return;
    reduce_.Apply(&r);
    Submit(ctx, std::move(done), r, nullptr, where);
  }

 private:
  ReduceAttrs reduce_;
};

class BarrierOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kBarrier, &dims, &r, &where)) return;
    Submit(ctx, std::move(done), r, nullptr, where);
  }
};

// This rank ran out of data: serves the other ranks' allreduces with zeros
// until every rank has joined; outputs the last rank to join.
class JoinOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    std::vector<int64_t> dims;
    kerasdist_request r;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kJoin, &dims, &r, &where)) return;
    r.dtype = static_cast<int32_t>(core::DataType::kInt32);
    r.ndim = 0;
    r.device = -1;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out),
        done);
    Submit(ctx, std::move(done), r, out->flat<::tensorflow::int32>().data(),
           Placement());
  }
};

}  // namespace

#define KD_REGISTER(NAME, CLASS) \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(::tensorflow::DEVICE_CPU), CLASS)

KD_REGISTER("KerasdistAllreduce", AllreduceOp);
KD_REGISTER("KerasdistGroupedAllreduce", GroupedAllreduceOp);
KD_REGISTER("KerasdistAllgather", AllgatherOp);
KD_REGISTER("KerasdistBroadcast", BroadcastOp);
KD_REGISTER("KerasdistAlltoall", AlltoallOp);
KD_REGISTER("KerasdistReducescatter", ReducescatterOp);
KD_REGISTER("KerasdistBarrier", BarrierOp);
KD_REGISTER("KerasdistJoin", JoinOp);

#ifdef KERASDIST_TF_GPU
#define KD_REGISTER_GPU(NAME, CLASS) \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(::tensorflow::DEVICE_GPU), CLASS)

KD_REGISTER_GPU("KerasdistAllreduce", AllreduceOp);
KD_REGISTER_GPU("KerasdistGroupedAllreduce", GroupedAllreduceOp);
KD_REGISTER_GPU("KerasdistAllgather", AllgatherOp);
KD_REGISTER_GPU("KerasdistBroadcast", BroadcastOp);
KD_REGISTER_GPU("KerasdistReducescatter", ReducescatterOp);
// The split sizes are read and written by the host.
REGISTER_KERNEL_BUILDER(Name("KerasdistAlltoall")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("splits")
                            .HostMemory("received_splits"),
                        AlltoallOp);
// A barrier has no tensors: it always runs on the host.
#endif

}  // namespace kerasdist::tf

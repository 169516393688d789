// AsyncOpKernels: each wraps its tensors, enqueues one Entry with the core
// runtime and returns; the runtime's background thread completes the op.
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
// allocated on the background thread, after the event: there the thread
// waits for TF's stream once before the collective may write them.
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/frontend.h"
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

::tensorflow::Status ToTf(const core::Status& s) {
  namespace errors = ::tensorflow::errors;
  switch (s.code()) {
    case core::StatusCode::kOk:
      return ::tensorflow::Status();
    case core::StatusCode::kInvalidArgument:
      return errors::InvalidArgument(s.message());
    // Ranks that disagree about a tensor: Horovod's error type.
    case core::StatusCode::kMismatch:
    case core::StatusCode::kPrecondition:
      return errors::FailedPrecondition(s.message());
    case core::StatusCode::kAborted:
      return errors::Aborted(s.message());
    case core::StatusCode::kInternal:
      return errors::Internal(s.message());
  }
  return errors::Unknown(s.message());
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
// every page again (about 5 ms per 64 MiB here).
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
  void Apply(core::Request* req) const {
    req->reduce_op = static_cast<core::ReduceOp>(reduce_op);
    req->prescale = prescale;
    req->postscale = postscale;
  }
};

// Shared by every kernel: the tensor name (attr, else the node name) and the
// enqueue with error handling.
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
  // Fills the parts of the request every op has, and *where.
  bool Begin(OpKernelContext* ctx, DoneCallback& done, core::OpType op,
             core::Entry* e, core::RuntimeRef* rt, Placement* where) {
    *rt = core::RuntimeRef::Current(process_set_);
    if (!*rt) {
      ctx->SetStatus(::tensorflow::errors::FailedPrecondition(
          "kerasdist is not initialized; call kerasdist.init() first."));
      done();
      return false;
    }
    ::tensorflow::Status placed = GetPlacement(ctx, on_gpu_, where);
    if (!placed.ok()) {
      ctx->SetStatus(placed);
      done();
      return false;
    }
    e->req.device = where->device;
    e->req.name = tensor_name_;
    e->req.op = op;
    if (ctx->num_inputs() > 0) {
      const Tensor& in = ctx->input(0);
      if (!ToCore(in.dtype(), &e->req.dtype)) {
        ctx->SetStatus(::tensorflow::errors::InvalidArgument(
            "kerasdist: unsupported dtype ",
            ::tensorflow::DataTypeString(in.dtype()), " for '", tensor_name_,
            "'."));
        done();
        return false;
      }
      e->req.shape = Dims(in.shape());
      e->input = in.tensor_data().data();
    }
    return true;
  }

  // Call once the op's own outputs are allocated (on a GPU the ready event
  // is recorded here).
  void Submit(OpKernelContext* ctx, DoneCallback done, core::RuntimeRef& rt,
              core::Entry e, const Placement& where) {
    void* ready = nullptr;
    ::tensorflow::Status recorded = RecordReady(where, &ready);
    if (!recorded.ok()) {
      ctx->SetStatus(recorded);
      done();
      return;
    }
    // From here on every ending goes through e.done (moved, not copied:
    // one allocation fewer per call), a failed enqueue included.
    if (!e.done) {
      e.done = [ctx, done = std::move(done)](const core::Result& r) {
        if (!r.status.ok()) ctx->SetStatus(ToTf(r.status));
        done();
      };
    }
    if (ready != nullptr) {
      e.ready_event = ready;
      e.done = [ready, device = where.device,
                inner = std::move(e.done)](const core::Result& r) {
        ReleaseReady(ready, device);
        inner(r);
      };
    }
    std::vector<core::Entry> one;
    one.push_back(std::move(e));
    size_t queued = 0;
    core::Status s = rt.EnqueueMany(one, &queued);
    // Entries not queued stay in `one`, their callbacks untouched.
    if (queued == 0)
      one[0].done(core::Result{
          s.ok() ? core::Status::Internal("kerasdist: the op was not queued.")
                 : s,
          {}});
  }

  // For results whose shape only negotiation knows. On a GPU the memory TF
  // hands out may still be in use by work queued on its stream after the
  // ready event, so the (background) thread waits for that stream first.
  static std::function<core::Status(const std::vector<int64_t>&, void**)>
  Allocator(OpKernelContext* ctx, int index, const Placement& where) {
    return [ctx, index, where](const std::vector<int64_t>& dims, void** data) {
      TensorShape shape;
      for (int64_t d : dims) shape.AddDim(d);
      Tensor* out = nullptr;
      ::tensorflow::Status s = ctx->allocate_output(index, shape, &out);
      if (!s.ok()) {
        return core::Status::Internal("could not allocate the output: " +
                                      std::string(s.message()));
      }
#ifdef KERASDIST_TF_GPU
      if (where.device >= 0) {
        KD_RETURN_IF_ERROR(
            core::DeviceHooks()->sync_stream(where.stream, where.device));
      }
#endif
      *data = Data(*out);
      return core::Status::OK();
    };
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
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAllreduce, &e, &rt, &where)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, outputs_.Get(ctx, 0, &out), done);
    e.input = ctx->input(0).tensor_data().data();
    e.output = Data(*out);
    reduce_.Apply(&e.req);
    e.req.group = group_;
    e.req.group_size = group_size_;
    Submit(ctx, done, rt, std::move(e), where);
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
    core::RuntimeRef rt = core::RuntimeRef::Current(process_set_);
    OP_REQUIRES_ASYNC(
        ctx, static_cast<bool>(rt),
        ::tensorflow::errors::FailedPrecondition(
            "kerasdist is not initialized; call kerasdist.init() first."),
        done);
    const int n = ctx->num_inputs();
    if (n == 0) {
      done();
      return;
    }
    Placement where;
    OP_REQUIRES_OK_ASYNC(ctx, GetPlacement(ctx, on_gpu_, &where), done);
    std::vector<core::Entry> entries(n);
    // A failure here fails the op before anything is enqueued.
    OP_REQUIRES_OK_ASYNC(ctx, MakeEntries(ctx, where, &entries), done);
    // Every output is allocated: the ready point for the whole group.
    void* ready = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, RecordReady(where, &ready), done);
    // The members' callbacks hold only this (one pointer: no allocation per
    // member); the op's own `done` is moved here once.
    auto state = std::make_shared<Countdown>(ctx, std::move(done), n, ready,
                                             where.device);
    for (core::Entry& e : entries) {
      e.ready_event = ready;
      e.done = [state](const core::Result& r) { state->Finish(r.status); };
    }
    size_t queued = 0;
    core::Status s = rt.EnqueueMany(entries, &queued);
    for (size_t i = queued; i < entries.size(); ++i) state->Finish(s);
  }

 private:
  // Completes the op when the last member finishes; keeps the first error.
  // On a GPU the members share one ready event, released with the last.
  class Countdown {
   public:
    Countdown(OpKernelContext* ctx, DoneCallback done, int n, void* ready,
              int device)
        : ctx_(ctx),
          done_(std::move(done)),
          left_(n),
          ready_(ready),
          device_(device) {}

    void Finish(const core::Status& s) {
      if (!s.ok()) {
        std::lock_guard<std::mutex> l(mu_);
        if (first_error_.ok()) first_error_ = s;
      }
      if (--left_ != 0) return;
      ReleaseReady(ready_, device_);
      if (!first_error_.ok()) ctx_->SetStatus(ToTf(first_error_));
      done_();
    }

   private:
    OpKernelContext* const ctx_;
    const DoneCallback done_;
    std::atomic<int> left_;
    std::mutex mu_;
    core::Status first_error_;
    void* const ready_;
    const int device_;
  };

  // One entry per input, its output allocated; `done` is left to the caller.
  ::tensorflow::Status MakeEntries(OpKernelContext* ctx, const Placement& where,
                                   std::vector<core::Entry>* entries) {
    const int n = static_cast<int>(entries->size());
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      core::Entry& e = (*entries)[i];
      Tensor* out = nullptr;
      TF_RETURN_IF_ERROR(outputs_.Get(ctx, i, &out));
      if (!ToCore(in.dtype(), &e.req.dtype)) {
        return ::tensorflow::errors::InvalidArgument(
            "kerasdist: unsupported dtype ",
            ::tensorflow::DataTypeString(in.dtype()));
      }
      e.req.name = names_[i];
      e.req.op = core::OpType::kAllreduce;
      e.req.shape = Dims(in.shape());
      reduce_.Apply(&e.req);
      e.req.group = base_;
      e.req.group_size = n;
      e.req.device = where.device;
      e.input = in.tensor_data().data();
      e.output = Data(*out);
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
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAllgather, &e, &rt, &where)) return;
    e.allocate = Allocator(ctx, 0, where);
    Submit(ctx, done, rt, std::move(e), where);
  }
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kBroadcast, &e, &rt, &where)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, outputs_.Get(ctx, 0, &out), done);
    e.input = ctx->input(0).tensor_data().data();
    e.output = Data(*out);
    e.req.root_rank = root_rank_;
    Submit(ctx, done, rt, std::move(e), where);
  }

 private:
  int root_rank_;
  OutputCache outputs_{on_gpu_};
};

class AlltoallOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kAlltoall, &e, &rt, &where)) return;
    const Tensor& splits = ctx->input(1);
    auto flat = splits.flat<int64_t>();
    e.req.splits.assign(flat.data(), flat.data() + flat.size());
    e.allocate = Allocator(ctx, 0, where);
    e.done = [ctx, done](const core::Result& r) {
      if (!r.status.ok()) {
        ctx->SetStatus(ToTf(r.status));
      } else {
        Tensor* out = nullptr;
        TensorShape shape({static_cast<int64_t>(r.recv_splits.size())});
        ::tensorflow::Status s = ctx->allocate_output(1, shape, &out);
        if (s.ok()) {
          auto o = out->flat<int64_t>();
          for (size_t i = 0; i < r.recv_splits.size(); ++i)
            o(i) = r.recv_splits[i];
        } else {
          ctx->SetStatus(s);
        }
      }
      done();
    };
    Submit(ctx, done, rt, std::move(e), where);
  }
};

class ReducescatterOp : public CollectiveKernel {
 public:
  explicit ReducescatterOp(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, reduce_.Read(c));
  }
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kReducescatter, &e, &rt, &where))
      return;
    reduce_.Apply(&e.req);
    e.allocate = Allocator(ctx, 0, where);
    Submit(ctx, done, rt, std::move(e), where);
  }

 private:
  ReduceAttrs reduce_;
};

class BarrierOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kBarrier, &e, &rt, &where)) return;
    e.req.dtype = core::DataType::kUInt8;
    Submit(ctx, done, rt, std::move(e), where);
  }
};

// This rank ran out of data: serves the other ranks' allreduces with zeros
// until every rank has joined; outputs the last rank to join.
class JoinOp : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::Entry e;
    core::RuntimeRef rt;
    Placement where;
    if (!Begin(ctx, done, core::OpType::kJoin, &e, &rt, &where)) return;
    e.req.dtype = core::DataType::kInt32;
    e.req.shape.clear();
    e.req.device = -1;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out),
        done);
    e.output = out->flat<::tensorflow::int32>().data();
    Submit(ctx, done, rt, std::move(e), Placement());
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

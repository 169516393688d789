// The host (CPU) collectives as XLA typed-FFI handler bodies, shared by the
// two front ends that run them inside a compiled program: JAX (jax/ffi.cc,
// compiled against jaxlib's XLA FFI headers, handlers exported as symbols
// that kerasdist.jax registers) and TensorFlow's XLA (tf/xla_ffi.cc,
// compiled against TensorFlow's copy of the headers, handlers registered
// with TensorFlow's XLA at load). Include it in one source file per library:
// everything here is internal to that file.
//
// Each handler enqueues its tensors through the core's C API, which
// negotiates them by name with the other ranks and fuses them, and returns
// an ffi::Future that completes when the core is done: XLA keeps running
// independent work meanwhile, as TF does with its AsyncOpKernels.
//
// Results whose size depends on other ranks (allgather, alltoall,
// reducescatter) are written straight into XLA's buffer once negotiation
// has given their shape and it matches the buffer's (the core's `allocate`
// callback): XLA sized that buffer at trace time, and a rank that disagrees
// must get an error, never a write past its end (its result goes to
// scratch memory, so that it still takes part in the collective). No copy
// where the shapes agree: one memcpy fewer per result.
//
// KERASDIST_FFI_TRACE names the includer's compiled function in errors
// ("jax.jit" unless defined first).
#ifndef KERASDIST_OPS_JAX_FFI_HANDLERS_H_
#define KERASDIST_OPS_JAX_FFI_HANDLERS_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/c_api.h"
#include "core/types.h"
#include "jax/ffi_common.h"
#include "xla/ffi/api/ffi.h"

#ifndef KERASDIST_FFI_TRACE
#define KERASDIST_FFI_TRACE "jax.jit"
#endif

namespace kerasdist::jax_ffi {
namespace {

namespace ffi = ::xla::ffi;
using ::kerasdist::core::DataType;
using ::kerasdist::core::OpType;

std::vector<int64_t> Dims(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

std::string DimsText(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(d[i]);
  }
  return s + "]";
}

void Complete(ffi::Promise promise, const std::string& failure) {
  if (failure.empty()) {
    promise.SetAvailable();
  } else {
    promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, failure));
  }
}

// Completes promises on one thread of its own, started at the first use and
// kept for the process. Completing a promise runs what XLA waits on it
// (the rest of the step may start there), so completing it on the core's
// background thread held that thread up: the JAX CNN at np=2 trained ~15%
// slower than with a thread per call. The core's callback only queues.
class Completer {
 public:
  static Completer& Get() {
    static Completer* c = new Completer();  // never destroyed: its thread
    return *c;                              // may outlive static teardown
  }
  void Post(ffi::Promise promise, std::string failure) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(std::move(promise), std::move(failure));
    }
    cv_.notify_one();
  }

 private:
  Completer() {
    std::thread([this] { Loop(); }).detach();
  }
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      std::deque<std::pair<ffi::Promise, std::string>> batch;
      batch.swap(queue_);
      lock.unlock();
      for (auto& [promise, failure] : batch) {
        Complete(std::move(promise), failure);
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<ffi::Promise, std::string>> queue_;
};

// One handler call: the promise XLA waits on and how its tensors ended.
// The last tensor to finish (or the handler itself, once it has enqueued
// them all) completes the promise: from the handler, on XLA's thread, when
// everything ended before it returned; else through the Completer, so no
// thread waits and the core's callback stays short.
class Call {
 public:
  explicit Call(size_t members) : failures_(members) {}

  ffi::Future future() { return ffi::Future(promise_); }

  // A tensor is about to be enqueued / has ended (`failure` empty if OK).
  void Add() { left_.fetch_add(1, std::memory_order_relaxed); }
  void Ended(size_t member, std::string failure) {
    if (!failure.empty()) failures_[member] = "kerasdist: " + failure;
    Release(false);
  }
  // The handler is done enqueueing; `error` is its own failure, if any,
  // which comes first, as the tensors enqueued before it still end.
  void Enqueued(ffi::Error error) {
    if (!error.success()) enqueue_error_ = error.message();
    Release(true);
  }

 private:
  void Release(bool on_xla_thread) {
    if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::string failure = enqueue_error_;
    for (const std::string& f : failures_) {
      if (failure.empty()) failure = f;  // the first member's, as TF reports
    }
    ffi::Promise promise = std::move(promise_);
    delete this;
    if (on_xla_thread) {
      Complete(std::move(promise), failure);
    } else {
      Completer::Get().Post(std::move(promise), std::move(failure));
    }
  }

  ffi::Promise promise_;
  std::atomic<int> left_{1};  // tensors in flight, plus the handler's hold
  std::string enqueue_error_;
  // One per member, each written by its own callback only.
  std::vector<std::string> failures_;
};

// One tensor of a call: its request's dtype, shape and input (null: a
// barrier), where its result goes and, for results sized by negotiation,
// the shape XLA allocated for it.
struct Pending {
  Call* call = nullptr;
  size_t member = 0;
  std::string name;
  int32_t dtype = 0;
  std::vector<int64_t> shape;
  const void* in = nullptr;
  void* out = nullptr;
  bool negotiated = false;  // sized by negotiation: `out` via Allocate
  std::vector<int64_t> out_dims;
  std::string error;          // Allocate's shape error, for Done
  std::vector<char> scratch;  // where such a result lands instead
};

std::string ShapeError(const Pending& p, const std::vector<int64_t>& got) {
  return "collective '" + p.name + "' produced shape " + DimsText(got) +
         " but this rank's " KERASDIST_FFI_TRACE " trace expected " +
         DimsText(p.out_dims) +
         ". Inside " KERASDIST_FFI_TRACE
         ", allgather needs the same first dimension on "
         "every rank and alltoall an even split (splits=None); call it "
         "outside " KERASDIST_FFI_TRACE " for uneven sizes.";
}

// kerasdist_allocate_fn of a result sized by negotiation: XLA's own buffer
// when the negotiated shape is the one it was sized for. Else the result
// lands in scratch memory and Done reports the error: this rank still
// takes part in the collective, as another rank, whose trace guessed the
// shape right, does (returning an error here would leave it waiting).
int32_t Allocate(void* arg, int32_t ndim, const int64_t* shape, void** data,
                 const char** message) {
  Pending& p = *static_cast<Pending*>(arg);
  std::vector<int64_t> got(shape, shape + ndim);
  if (got == p.out_dims) {
    *data = p.out;
    return 0;
  }
  p.error = ShapeError(p, got);
  int64_t elements = 1;
  for (int64_t d : got) elements *= d;
  const int64_t bytes = elements * ::kerasdist::core::DataTypeSize(
                                       static_cast<DataType>(p.dtype));
  p.scratch.resize(std::max<int64_t>(1, bytes));
  *data = p.scratch.data();
  return 0;
}

// The core's completion callback of one tensor.
void Done(void* arg, const kerasdist_result* r) {
  std::unique_ptr<Pending> p(static_cast<Pending*>(arg));
  p->call->Ended(p->member,
                 r->status != 0 ? std::string(r->message) : p->error);
}

// Enqueues `members` (of one call) with one kerasdist_enqueue_tensors
// call, as the TF op does: one lock and one wake-up of the core's thread, so
// the core sees a group whole. Done owns each member queued; those not
// queued are counted out of their call. The enqueue's error, if any.
ffi::Error Submit(const Spec& s,
                  std::vector<std::unique_ptr<Pending>> members) {
  const size_t n = members.size();
  std::vector<kerasdist_request> requests(n);
  std::vector<kerasdist_tensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    Pending& p = *members[i];
    requests[i] = Request(p.name, s, p.dtype, p.shape, -1);
    tensors[i] = {&requests[i],
                  p.in,
                  p.negotiated ? nullptr : p.out,
                  nullptr,
                  p.negotiated ? &Allocate : nullptr,
                  &Done,
                  &p};
    p.call->Add();  // before the enqueue: the callback may come at once
  }
  int32_t queued = 0;
  const int code = kerasdist_enqueue_tensors(tensors.data(),
                                             static_cast<int32_t>(n), &queued);
  for (int32_t i = 0; i < queued; ++i) members[i].release();  // Done owns it
  if (code == 0) return ffi::Error::Success();
  for (size_t i = queued; i < n; ++i) {
    members[i]->call->Ended(members[i]->member, "");  // drops its hold
  }
  return ffi::Error::InvalidArgument(std::string("kerasdist: ") +
                                     kerasdist_last_error());
}

// Member `member` of `call`: `in`, its result straight into `out`, which
// with `negotiated` Allocate hands over once the result's shape is checked.
// Null for a dtype the core does not reduce.
std::unique_ptr<Pending> Member(Call* call, size_t member, std::string name,
                                const ffi::AnyBuffer& in,
                                const ffi::AnyBuffer& out, bool negotiated) {
  auto p = std::make_unique<Pending>();
  if (!ToCore(in.element_type(), &p->dtype)) return nullptr;
  p->call = call;
  p->member = member;
  p->name = std::move(name);
  p->shape = Dims(in);
  p->in = in.untyped_data();
  p->out = out.untyped_data();
  p->negotiated = negotiated;
  p->out_dims = Dims(out);
  return p;
}

ffi::Future One(std::string_view name, const Spec& s, const ffi::AnyBuffer& in,
                ffi::AnyBuffer* out, bool negotiated) {
  Call* call = new Call(1);
  ffi::Future future = call->future();
  std::vector<std::unique_ptr<Pending>> members;
  members.push_back(Member(call, 0, std::string(name), in, *out, negotiated));
  if (!members[0]) {
    call->Enqueued(ffi::Error::InvalidArgument(
        "kerasdist: collective '" + std::string(name) +
        "' got an unsupported dtype; "
        "expected float16, bfloat16, float32, float64, int32, int64, uint8 "
        "or bool."));
    return future;
  }
  call->Enqueued(Submit(s, std::move(members)));
  return future;
}

ffi::Future AllreduceImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name, int32_t reduce_op,
                          double prescale, double postscale,
                          int32_t process_set) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  s.process_set = process_set;
  return One(name, s, x, &*y, false);
}

// Members are named `<name>.<i>` and form one group, as in the TF op: the
// core fuses them into as few collectives as the threshold allows.
ffi::Future GroupedAllreduceImpl(ffi::RemainingArgs xs, ffi::RemainingRets ys,
                                 std::string_view name, int32_t reduce_op,
                                 double prescale, double postscale,
                                 int32_t process_set) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  s.process_set = process_set;
  s.group = std::string(name);
  s.group_size = static_cast<int32_t>(xs.size());
  // Every member is checked before any is enqueued: a group short of a
  // member would keep the other ranks waiting for it.
  Call* call = new Call(xs.size());
  ffi::Future future = call->future();
  std::vector<std::unique_ptr<Pending>> members;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (x.has_value() && y.has_value()) {
      members.push_back(
          Member(call, i, s.group + "." + std::to_string(i), *x, **y, false));
    }
    if (!x.has_value() || !y.has_value() || !members.back()) {
      call->Enqueued(ffi::Error::InvalidArgument(
          "kerasdist: grouped allreduce '" + s.group + "': member " +
          std::to_string(i) + " is not a buffer of a supported dtype."));
      return future;
    }
  }
  call->Enqueued(Submit(s, std::move(members)));
  return future;
}

ffi::Future AllgatherImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name, int32_t process_set) {
  Spec s;
  s.op = OpType::kAllgather;
  s.process_set = process_set;
  return One(name, s, x, &*y, true);
}

ffi::Future BroadcastImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name, int32_t root_rank,
                          int32_t process_set) {
  Spec s;
  s.op = OpType::kBroadcast;
  s.process_set = process_set;
  s.root_rank = root_rank;
  return One(name, s, x, &*y, false);
}

ffi::Future AlltoallImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         std::string_view name, ffi::Span<const int64_t> splits,
                         int32_t process_set) {
  Spec s;
  s.op = OpType::kAlltoall;
  s.process_set = process_set;
  s.splits.assign(splits.begin(), splits.end());
  return One(name, s, x, &*y, true);
}

ffi::Future ReducescatterImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                              std::string_view name, int32_t reduce_op,
                              double prescale, double postscale,
                              int32_t process_set) {
  Spec s = ReduceSpec(OpType::kReducescatter, reduce_op, prescale, postscale);
  s.process_set = process_set;
  return One(name, s, x, &*y, true);
}

// A barrier has no data; XLA needs a result, so it writes a scalar the
// Python side ignores (it orders what depends on it).
ffi::Future BarrierImpl(ffi::Result<ffi::AnyBuffer> token,
                        std::string_view name, int32_t process_set) {
  std::memset(token->untyped_data(), 0, token->size_bytes());
  Spec s;
  s.op = OpType::kBarrier;
  s.process_set = process_set;
  Call* call = new Call(1);
  ffi::Future future = call->future();
  std::vector<std::unique_ptr<Pending>> members;
  members.push_back(std::make_unique<Pending>());
  members[0]->call = call;
  members[0]->name = std::string(name);
  members[0]->dtype = static_cast<int32_t>(DataType::kUInt8);
  call->Enqueued(Submit(s, std::move(members)));
  return future;
}

// The handlers' signatures (arguments, results and attributes, by name).
inline auto AllreduceBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("reduce_op")
      .Attr<double>("prescale_factor")
      .Attr<double>("postscale_factor")
      .Attr<int32_t>("process_set");
}

inline auto GroupedAllreduceBinding() {
  return ffi::Ffi::Bind()
      .RemainingArgs()
      .RemainingRets()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("reduce_op")
      .Attr<double>("prescale_factor")
      .Attr<double>("postscale_factor")
      .Attr<int32_t>("process_set");
}

inline auto AllgatherBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("process_set");
}

inline auto BroadcastBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("root_rank")
      .Attr<int32_t>("process_set");
}

inline auto AlltoallBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<ffi::Span<const int64_t>>("splits")
      .Attr<int32_t>("process_set");
}

inline auto ReducescatterBinding() { return AllreduceBinding(); }

inline auto BarrierBinding() {
  return ffi::Ffi::Bind()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("process_set");
}

}  // namespace
}  // namespace kerasdist::jax_ffi

#endif  // KERASDIST_OPS_JAX_FFI_HANDLERS_H_

// JAX front end: the collectives as XLA FFI handlers (custom calls), so they
// run inside jax.jit. Each handler enqueues its tensors through the core's C
// API, which negotiates them by name with the other ranks and fuses them, and
// returns an ffi::Future that completes when the core is done: XLA keeps
// running independent work meanwhile, as TF does with its AsyncOpKernels.
//
// Results whose size depends on other ranks (allgather, alltoall,
// reducescatter) land in memory the core owns and are copied into XLA's
// buffer after their shape is checked: XLA sized that buffer at trace time,
// and a rank that disagrees must get an error, never a write past its end.

#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/c_api.h"
#include "core/types.h"
#include "xla/ffi/api/ffi.h"
#include "jax/ffi_common.h"

namespace ffi = xla::ffi;
using kerasdist::core::DataType;
using kerasdist::core::OpType;

namespace {

using kerasdist::jax_ffi::Request;
using kerasdist::jax_ffi::ReduceSpec;
using kerasdist::jax_ffi::Spec;
using kerasdist::jax_ffi::ToCore;

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

// One enqueued tensor: where its result goes and, for results the core
// owns, the shape XLA allocated for it.
struct Pending {
  std::string name;
  int64_t handle = 0;
  void* out = nullptr;
  size_t out_bytes = 0;
  bool copy_out = false;
  std::vector<int64_t> out_dims;
};

// Enqueues one tensor (`in` may be null: a barrier) and records it.
ffi::Error Submit(Pending p, const Spec& s, int32_t dtype,
                  std::vector<int64_t> shape, const void* in,
                  std::vector<Pending>* pending) {
  kerasdist_request r = Request(p.name, s, dtype, shape, -1);
  p.handle = kerasdist_enqueue(&r, in, p.copy_out ? nullptr : p.out);
  if (p.handle == 0) {
    return ffi::Error::InvalidArgument(std::string("kerasdist: ") +
                                       kerasdist_last_error());
  }
  pending->push_back(std::move(p));
  return ffi::Error::Success();
}

// Enqueues `in`; the result goes straight into `out`, or, with `copy_out`,
// into core-owned memory that Finish copies after checking its shape.
ffi::Error Enqueue(const std::string& name, const Spec& s,
                   const ffi::AnyBuffer& in, ffi::AnyBuffer* out, bool copy_out,
                   std::vector<Pending>* pending) {
  int32_t dtype;
  if (!ToCore(in.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument(
        "kerasdist: collective '" + name + "' got an unsupported dtype; "
        "expected float16, bfloat16, float32, float64, int32, int64, uint8 "
        "or bool.");
  }
  Pending p;
  p.name = name;
  p.out = out->untyped_data();
  p.out_bytes = out->size_bytes();
  p.copy_out = copy_out;
  p.out_dims = Dims(*out);
  return Submit(std::move(p), s, dtype, Dims(in), in.untyped_data(), pending);
}

// Waits for one finished handle and moves a core-owned result into XLA's
// buffer; returns the first failure's message, empty when all went well.
std::string Finish(const Pending& p) {
  kerasdist_wait(p.handle, -1.0);
  if (kerasdist_handle_status(p.handle) != 0) {
    return kerasdist_handle_message(p.handle);
  }
  if (!p.copy_out) return "";
  int32_t ndim = 0;
  int64_t shape[32];
  const void* data = kerasdist_handle_output(p.handle, &ndim, shape);
  std::vector<int64_t> got(shape, shape + ndim);
  if (got != p.out_dims) {
    return "collective '" + p.name + "' produced shape " + DimsText(got) +
           " but this rank's jax.jit trace expected " + DimsText(p.out_dims) +
           ". Inside jax.jit, allgather needs the same first dimension on "
           "every rank and alltoall an even split (splits=None); call it "
           "outside jax.jit for uneven sizes.";
  }
  if (p.out_bytes > 0) std::memcpy(p.out, data, p.out_bytes);
  return "";
}

// Completes `promise` once every pending tensor is done. The C API offers
// waits, not completion callbacks, so a short-lived thread does the waiting.
ffi::Future Complete(std::vector<Pending> pending, ffi::Error enqueue_error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::thread([promise, pending = std::move(pending),
               err = std::move(enqueue_error)]() mutable {
    std::string failure = err.success() ? "" : err.message();
    for (const Pending& p : pending) {
      std::string m = Finish(p);  // every handle is waited for and released
      if (failure.empty() && !m.empty()) failure = "kerasdist: " + m;
      kerasdist_release(p.handle);
    }
    if (failure.empty()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ffi::Error(ffi::ErrorCode::kInternal, failure));
    }
  }).detach();
  return future;
}

ffi::Future One(std::string_view name, const Spec& s, const ffi::AnyBuffer& in,
                ffi::AnyBuffer* out, bool copy_out) {
  std::vector<Pending> pending;
  ffi::Error e = Enqueue(std::string(name), s, in, out, copy_out, &pending);
  return Complete(std::move(pending), std::move(e));
}

ffi::Future AllreduceImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name, int32_t reduce_op,
                          double prescale, double postscale) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  return One(name, s, x, &*y, false);
}

// Members are named `<name>.<i>` and form one group, as in the TF op: the
// core fuses them into as few collectives as the threshold allows.
ffi::Future GroupedAllreduceImpl(ffi::RemainingArgs xs, ffi::RemainingRets ys,
                                 std::string_view name, int32_t reduce_op,
                                 double prescale, double postscale) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  s.group = std::string(name);
  s.group_size = static_cast<int32_t>(xs.size());
  // Every member is checked before any is enqueued: a group short of a
  // member would keep the other ranks waiting for it.
  std::vector<ffi::AnyBuffer> ins, outs;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    int32_t dtype;
    if (!x.has_value() || !y.has_value() ||
        !ToCore(x->element_type(), &dtype)) {
      return Complete({}, ffi::Error::InvalidArgument(
                              "kerasdist: grouped allreduce '" + s.group +
                              "': member " + std::to_string(i) +
                              " is not a buffer of a supported dtype."));
    }
    ins.push_back(*x);
    outs.push_back(**y);
  }
  std::vector<Pending> pending;
  ffi::Error err = ffi::Error::Success();
  for (size_t i = 0; i < ins.size() && err.success(); ++i) {
    err = Enqueue(s.group + "." + std::to_string(i), s, ins[i], &outs[i],
                  false, &pending);
  }
  return Complete(std::move(pending), std::move(err));
}

ffi::Future AllgatherImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name) {
  Spec s;
  s.op = OpType::kAllgather;
  return One(name, s, x, &*y, true);
}

ffi::Future BroadcastImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          std::string_view name, int32_t root_rank) {
  Spec s;
  s.op = OpType::kBroadcast;
  s.root_rank = root_rank;
  return One(name, s, x, &*y, false);
}

ffi::Future AlltoallImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         std::string_view name,
                         ffi::Span<const int64_t> splits) {
  Spec s;
  s.op = OpType::kAlltoall;
  s.splits.assign(splits.begin(), splits.end());
  return One(name, s, x, &*y, true);
}

ffi::Future ReducescatterImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                              std::string_view name, int32_t reduce_op,
                              double prescale, double postscale) {
  Spec s = ReduceSpec(OpType::kReducescatter, reduce_op, prescale, postscale);
  return One(name, s, x, &*y, true);
}

// A barrier has no data; XLA needs a result, so it writes a scalar the
// Python side ignores (it orders what depends on it).
ffi::Future BarrierImpl(ffi::Result<ffi::AnyBuffer> token,
                        std::string_view name) {
  std::memset(token->untyped_data(), 0, token->size_bytes());
  Spec s;
  s.op = OpType::kBarrier;
  Pending p;
  p.name = std::string(name);
  std::vector<Pending> pending;
  ffi::Error e = Submit(std::move(p), s,
                        static_cast<int32_t>(DataType::kUInt8), {}, nullptr,
                        &pending);
  return Complete(std::move(pending), std::move(e));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllreduce, AllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("reduce_op")
                                  .Attr<double>("prescale")
                                  .Attr<double>("postscale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistGroupedAllreduce, GroupedAllreduceImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("reduce_op")
                                  .Attr<double>("prescale")
                                  .Attr<double>("postscale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllgather, AllgatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBroadcast, BroadcastImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("root_rank"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAlltoall, AlltoallImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<ffi::Span<const int64_t>>("splits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistReducescatter, ReducescatterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("reduce_op")
                                  .Attr<double>("prescale")
                                  .Attr<double>("postscale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBarrier, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name"));

// The CUDA-platform collectives as XLA typed-FFI handler bodies (allreduce,
// grouped allreduce, broadcast and the barrier: the collectives whose result
// has the input's shape), shared by the two front ends that run them inside
// a compiled program on a GPU: JAX (jax/ffi_cuda.cc, against jaxlib's XLA
// FFI headers, handlers exported as symbols) and TensorFlow's XLA
// (tf/xla_ffi_cuda.cc, against TensorFlow's copy, registered with its XLA
// at load). Include it in one source file per library: everything here is
// internal to that file. Built only with the core's GPU backend
// (KERASDIST_WITH_NCCL); the core's NCCL backend (or the host-staged one,
// KERASDIST_GPU_OPERATIONS=MPI) moves the data.
//
// A handler records an event on XLA's stream after the work that produces
// its inputs and enqueues the device pointers with it (the core's
// communication stream waits on that event, not the host on the whole
// stream), then blocks until the core's callback says the collectives are
// done: the outputs are written before XLA queues anything after the call.
// The collectives of one group still travel in one fused NCCL call.
#ifndef KERASDIST_OPS_JAX_FFI_CUDA_HANDLERS_H_
#define KERASDIST_OPS_JAX_FFI_CUDA_HANDLERS_H_

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/backends/gpu/on_device.h"
#include "core/c_api.h"
#include "core/types.h"
#include "jax/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace kerasdist::jax_ffi_cuda {
namespace {

namespace ffi = ::xla::ffi;
using ::kerasdist::core::DataType;
using ::kerasdist::core::OnDevice;
using ::kerasdist::core::OpType;
using kerasdist::jax_ffi::ReduceSpec;
using kerasdist::jax_ffi::Request;
using kerasdist::jax_ffi::Spec;
using kerasdist::jax_ffi::ToCore;

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error(
      ffi::ErrorCode::kInternal,
      std::string("kerasdist: ") + what + ": " + cudaGetErrorString(e));
}

// The CUDA ordinal of the GPU holding `ptr` (the current one for an empty
// buffer, which has no pointer).
int DeviceOf(const void* ptr) {
  cudaPointerAttributes attr{};
  if (ptr != nullptr && cudaPointerGetAttributes(&attr, ptr) == cudaSuccess &&
      attr.type == cudaMemoryTypeDevice) {
    return attr.device;
  }
  int device = 0;
  cudaGetDevice(&device);
  return device;
}

// The collectives one handler call enqueued: the core's callback counts
// them down, the handler's thread waits for the last.
class Waiter {
 public:
  void Add() {
    std::lock_guard<std::mutex> l(mu_);
    ++left_;
  }
  static void Done(void* arg, const kerasdist_result* r) {
    auto* w = static_cast<Waiter*>(arg);
    std::lock_guard<std::mutex> l(w->mu_);
    if (r->status != 0 && w->failure_.empty()) w->failure_ = r->message;
    if (--w->left_ == 0) w->cv_.notify_all();
  }
  // Waits for every collective added; the first failure's message, or "".
  std::string Wait() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return left_ == 0; });
    return failure_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_ = 0;
  std::string failure_;
};

// Enqueues `tensors` (whose callbacks count down `w`) with one
// kerasdist_enqueue_tensors call, as the TF op does, so the core sees a
// group whole; each is added to `w`. The enqueue's error, or "".
std::string Enqueue(std::vector<kerasdist_tensor>& tensors, Waiter* w) {
  const int32_t n = static_cast<int32_t>(tensors.size());
  for (int32_t i = 0; i < n; ++i) w->Add();  // callbacks may come at once
  int32_t queued = 0;
  if (kerasdist_enqueue_tensors(tensors.data(), n, &queued) == 0) return "";
  std::string failure = kerasdist_last_error();
  kerasdist_result gone{};  // those not queued are never called back
  for (int32_t i = queued; i < n; ++i) Waiter::Done(w, &gone);
  return failure;
}

struct Member {
  std::string name;
  ffi::AnyBuffer in;
  ffi::AnyBuffer out;
};

// Enqueues `members` (every one checked first: a group short of a member
// would keep the other ranks waiting) together; each is added to `w`. The
// failure's message, or "".
std::string EnqueueMembers(const Spec& s, std::vector<Member>& members,
                           void* ready, Waiter* w) {
  const size_t n = members.size();
  std::vector<std::vector<int64_t>> shapes(n);
  std::vector<kerasdist_request> requests(n);
  std::vector<kerasdist_tensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    Member& m = members[i];
    int32_t dtype;
    if (!ToCore(m.in.element_type(), &dtype)) {
      return "collective '" + m.name + "' got an unsupported dtype.";
    }
    auto d = m.in.dimensions();
    shapes[i].assign(d.begin(), d.end());
    requests[i] =
        Request(m.name, s, dtype, shapes[i], DeviceOf(m.in.untyped_data()));
    tensors[i] = {&requests[i],
                  m.in.untyped_data(),
                  m.out.untyped_data(),
                  ready,
                  nullptr,
                  &Waiter::Done,
                  w};
  }
  return Enqueue(tensors, w);
}

// Enqueues every member (all before any wait: the core sees a group whole)
// behind one event on XLA's stream, and waits for all; the first failure's
// message, or empty.
std::string RunMembers(cudaStream_t stream, const Spec& s,
                       std::vector<Member>& members) {
  if (members.empty()) return "";
  const int device = DeviceOf(members[0].in.untyped_data());
  cudaEvent_t ready = nullptr;
  {
    OnDevice on(device);
    cudaError_t e = on.status();
    if (e == cudaSuccess) {
      e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    }
    if (e == cudaSuccess) e = cudaEventRecord(ready, stream);
    if (e != cudaSuccess) {
      if (ready != nullptr) cudaEventDestroy(ready);
      return std::string("recording an event on XLA's stream: ") +
             cudaGetErrorString(e);
    }
  }
  Waiter w;
  const std::string failure = EnqueueMembers(s, members, ready, &w);
  std::string ended = w.Wait();
  // The core is done with the event once every collective it was handed
  // with has ended (a pending record or wait keeps it alive in CUDA).
  cudaEventDestroy(ready);
  return failure.empty() ? ended : failure;
}

ffi::Error Run(cudaStream_t stream, const Spec& s,
               std::vector<Member> members) {
  std::string failure = RunMembers(stream, s, members);
  if (!failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "kerasdist: " + failure);
  }
  return ffi::Error::Success();
}

ffi::Error AllreduceImpl(cudaStream_t stream, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, std::string_view name,
                         int32_t reduce_op, double prescale, double postscale,
                         int32_t process_set) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  s.process_set = process_set;
  return Run(stream, s, {{std::string(name), x, *y}});
}

// Members are named `<name>.<i>` and form one group, as on the CPU.
ffi::Error GroupedAllreduceImpl(cudaStream_t stream, ffi::RemainingArgs xs,
                                ffi::RemainingRets ys, std::string_view name,
                                int32_t reduce_op, double prescale,
                                double postscale, int32_t process_set) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  s.process_set = process_set;
  s.group = std::string(name);
  s.group_size = static_cast<int32_t>(xs.size());
  std::vector<Member> members;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!x.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument(
          "kerasdist: grouped allreduce '" + s.group + "': member " +
          std::to_string(i) + " is not a buffer.");
    }
    members.push_back({s.group + "." + std::to_string(i), *x, **y});
  }
  return Run(stream, s, std::move(members));
}

ffi::Error BroadcastImpl(cudaStream_t stream, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, std::string_view name,
                         int32_t root_rank, int32_t process_set) {
  Spec s;
  s.op = OpType::kBroadcast;
  s.process_set = process_set;
  s.root_rank = root_rank;
  return Run(stream, s, {{std::string(name), x, *y}});
}

ffi::Error BarrierImpl(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> token,
                       std::string_view name, int32_t process_set) {
  cudaError_t e =
      cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream);
  if (e != cudaSuccess) return CudaError("clearing the barrier's token", e);
  // A barrier has no input to wait for with an event: it stands for this
  // rank's work so far, so the stream is finished first, as before.
  e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return CudaError("waiting for XLA's stream", e);
  kerasdist_request r{};
  std::string n(name);
  r.name = n.c_str();
  r.op = static_cast<int32_t>(OpType::kBarrier);
  r.dtype = static_cast<int32_t>(DataType::kUInt8);
  r.device = -1;
  r.process_set = process_set;
  Waiter w;
  std::vector<kerasdist_tensor> t = {
      {&r, nullptr, nullptr, nullptr, nullptr, &Waiter::Done, &w}};
  std::string failure = Enqueue(t, &w);
  std::string ended = w.Wait();
  if (failure.empty()) failure = ended;
  if (!failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "kerasdist: " + failure);
  }
  return ffi::Error::Success();
}

// The handlers' signatures (XLA's stream, arguments, results and
// attributes, by name).
inline auto AllreduceBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
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
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("reduce_op")
      .Attr<double>("prescale_factor")
      .Attr<double>("postscale_factor")
      .Attr<int32_t>("process_set");
}

inline auto BroadcastBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("root_rank")
      .Attr<int32_t>("process_set");
}

inline auto BarrierBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("tensor_name")
      .Attr<int32_t>("process_set");
}

}  // namespace
}  // namespace kerasdist::jax_ffi_cuda

#endif  // KERASDIST_OPS_JAX_FFI_CUDA_HANDLERS_H_

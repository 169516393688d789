// JAX front end on NVIDIA GPUs: the collectives whose result has the input's
// shape (allreduce, grouped allreduce, broadcast) and the barrier as XLA FFI
// handlers for the CUDA platform, so a jitted step on a GPU (Keras-on-JAX's
// train step) calls them on device memory. Built only with the core's GPU
// backend (KERASDIST_WITH_NCCL); the core's NCCL backend (or the host-staged
// one, KERASDIST_GPU_OPERATIONS=MPI) moves the data.
//
// The C API takes no ready event, so a handler first waits for XLA's stream
// (its inputs are then complete), enqueues device pointers, waits for the
// core to finish and returns: the outputs are written before XLA queues
// anything after the call. A blocking call, the price of the C API; the
// collectives of one group still travel in one fused NCCL call.

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>
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

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("kerasdist: ") + what + ": " +
                        cudaGetErrorString(e));
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

struct Member {
  std::string name;
  ffi::AnyBuffer in;
  ffi::AnyBuffer out;
};

// Enqueues every member (all before any wait: the core sees a group whole),
// waits for all, releases them; the first failure's message, or empty.
std::string RunMembers(const Spec& s, std::vector<Member>& members) {
  std::vector<int64_t> handles;
  std::string failure;
  for (Member& m : members) {
    int32_t dtype;
    if (!ToCore(m.in.element_type(), &dtype)) {
      failure = "collective '" + m.name + "' got an unsupported dtype.";
      break;
    }
    auto d = m.in.dimensions();
    std::vector<int64_t> shape(d.begin(), d.end());
    kerasdist_request r = Request(m.name, s, dtype, shape,
                                  DeviceOf(m.in.untyped_data()));
    int64_t h = kerasdist_enqueue(&r, m.in.untyped_data(),
                                  m.out.untyped_data());
    if (h == 0) {
      failure = kerasdist_last_error();
      break;
    }
    handles.push_back(h);
  }
  for (int64_t h : handles) {
    kerasdist_wait(h, -1.0);
    if (failure.empty() && kerasdist_handle_status(h) != 0) {
      failure = kerasdist_handle_message(h);
    }
    kerasdist_release(h);
  }
  return failure;
}

ffi::Error Run(cudaStream_t stream, const Spec& s,
               std::vector<Member> members) {
  // XLA queued what produces the inputs on `stream`: let it finish.
  cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return CudaError("waiting for XLA's stream", e);
  std::string failure = RunMembers(s, members);
  if (!failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "kerasdist: " + failure);
  }
  return ffi::Error::Success();
}

ffi::Error AllreduceImpl(cudaStream_t stream, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, std::string_view name,
                         int32_t reduce_op, double prescale,
                         double postscale) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
  return Run(stream, s, {{std::string(name), x, *y}});
}

// Members are named `<name>.<i>` and form one group, as on the CPU.
ffi::Error GroupedAllreduceImpl(cudaStream_t stream, ffi::RemainingArgs xs,
                                ffi::RemainingRets ys, std::string_view name,
                                int32_t reduce_op, double prescale,
                                double postscale) {
  Spec s = ReduceSpec(OpType::kAllreduce, reduce_op, prescale, postscale);
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
                         int32_t root_rank) {
  Spec s;
  s.op = OpType::kBroadcast;
  s.root_rank = root_rank;
  return Run(stream, s, {{std::string(name), x, *y}});
}

ffi::Error BarrierImpl(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> token,
                       std::string_view name) {
  cudaError_t e = cudaMemsetAsync(token->untyped_data(), 0,
                                  token->size_bytes(), stream);
  if (e != cudaSuccess) return CudaError("clearing the barrier's token", e);
  e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return CudaError("waiting for XLA's stream", e);
  kerasdist_request r{};
  std::string n(name);
  r.name = n.c_str();
  r.op = static_cast<int32_t>(OpType::kBarrier);
  r.dtype = static_cast<int32_t>(DataType::kUInt8);
  r.device = -1;
  int64_t h = kerasdist_enqueue(&r, nullptr, nullptr);
  if (h == 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("kerasdist: ") + kerasdist_last_error());
  }
  kerasdist_wait(h, -1.0);
  std::string failure = kerasdist_handle_status(h) != 0
                            ? kerasdist_handle_message(h) : "";
  kerasdist_release(h);
  if (!failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "kerasdist: " + failure);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllreduceCuda, AllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("reduce_op")
                                  .Attr<double>("prescale")
                                  .Attr<double>("postscale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistGroupedAllreduceCuda,
                              GroupedAllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("reduce_op")
                                  .Attr<double>("prescale")
                                  .Attr<double>("postscale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBroadcastCuda, BroadcastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name")
                                  .Attr<int32_t>("root_rank"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBarrierCuda, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("name"));

// The CUDA handlers of the custom calls that tf/xla_kernels.cc lowers
// allreduce, grouped allreduce, broadcast and the barrier to inside
// tf.function(jit_compile=True) on a GPU: JAX's CUDA handler bodies
// (jax/ffi_cuda_handlers.h) compiled against TensorFlow's copy of XLA's FFI
// headers and registered, when the op library loads, with the XLA inside
// TensorFlow for the CUDA platform. Built only with the core's GPU backend
// (KERASDIST_WITH_NCCL) and the XLA kernels (TF_XLA). allgather, alltoall
// and reducescatter have no CUDA handler (their result's size comes from
// the other ranks): the Python side refuses them inside XLA on a GPU.

#include "jax/ffi_cuda_handlers.h"
#include "tf/xla_targets.h"

namespace xla::ffi {
// TensorFlow's XLA FFI instance (see tf/xla_ffi.cc).
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

namespace kerasdist::tf {
namespace {

namespace jc = ::kerasdist::jax_ffi_cuda;

XLA_FFI_DEFINE_HANDLER(kAllreduceCuda, jc::AllreduceImpl,
                       jc::AllreduceBinding());
XLA_FFI_DEFINE_HANDLER(kGroupedAllreduceCuda, jc::GroupedAllreduceImpl,
                       jc::GroupedAllreduceBinding());
XLA_FFI_DEFINE_HANDLER(kBroadcastCuda, jc::BroadcastImpl,
                       jc::BroadcastBinding());
XLA_FFI_DEFINE_HANDLER(kBarrierCuda, jc::BarrierImpl, jc::BarrierBinding());

// "CUDA" is the platform of TensorFlow's XLA on an NVIDIA GPU.
#define KD_REGISTER_CUDA(TARGET, HANDLER) \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), TARGET, "CUDA", HANDLER)

KD_REGISTER_CUDA(xla_targets::kAllreduce, kAllreduceCuda);
KD_REGISTER_CUDA(xla_targets::kGroupedAllreduce, kGroupedAllreduceCuda);
KD_REGISTER_CUDA(xla_targets::kBroadcast, kBroadcastCuda);
KD_REGISTER_CUDA(xla_targets::kBarrier, kBarrierCuda);

}  // namespace
}  // namespace kerasdist::tf

// Asked by kerasdist/tensorflow/_native.py: this op library has the XLA
// kernels for GPUs too (allreduce, grouped allreduce, broadcast, barrier).
extern "C" __attribute__((visibility("default"))) int
kerasdist_tf_xla_gpu_kernels(void) {
  return 1;
}

// The handlers of the custom calls that tf/xla_kernels.cc lowers the
// collectives to inside tf.function(jit_compile=True): JAX's handler bodies
// (jax/ffi_handlers.h), compiled here against TensorFlow's copy of XLA's FFI
// headers and registered, when the op library loads, with the XLA inside
// TensorFlow (its own registry, apart from jaxlib's) for the host platform.
// Kept apart from xla_kernels.cc, which needs XLA's builder headers: this
// file needs only the FFI's.

#define KERASDIST_FFI_TRACE "tf.function(jit_compile=True)"
#include "jax/ffi_handlers.h"
#include "tf/xla_targets.h"

namespace xla::ffi {
// TensorFlow's XLA FFI instance (libtensorflow_cc exports it; declared in
// xla/ffi/ffi_api.h, whose includes reach far beyond the FFI's).
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

namespace kerasdist::tf {
namespace {

namespace jf = ::kerasdist::jax_ffi;

XLA_FFI_DEFINE_HANDLER(kAllreduce, jf::AllreduceImpl, jf::AllreduceBinding());
XLA_FFI_DEFINE_HANDLER(kGroupedAllreduce, jf::GroupedAllreduceImpl,
                       jf::GroupedAllreduceBinding());
XLA_FFI_DEFINE_HANDLER(kAllgather, jf::AllgatherImpl, jf::AllgatherBinding());
XLA_FFI_DEFINE_HANDLER(kBroadcast, jf::BroadcastImpl, jf::BroadcastBinding());
XLA_FFI_DEFINE_HANDLER(kAlltoall, jf::AlltoallImpl, jf::AlltoallBinding());
XLA_FFI_DEFINE_HANDLER(kReducescatter, jf::ReducescatterImpl,
                       jf::ReducescatterBinding());
XLA_FFI_DEFINE_HANDLER(kBarrier, jf::BarrierImpl, jf::BarrierBinding());

// "Host" is the platform of TensorFlow's XLA on the CPU.
#define KD_REGISTER(TARGET, HANDLER) \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), TARGET, "Host", HANDLER)

KD_REGISTER(xla_targets::kAllreduce, kAllreduce);
KD_REGISTER(xla_targets::kGroupedAllreduce, kGroupedAllreduce);
KD_REGISTER(xla_targets::kAllgather, kAllgather);
KD_REGISTER(xla_targets::kBroadcast, kBroadcast);
KD_REGISTER(xla_targets::kAlltoall, kAlltoall);
KD_REGISTER(xla_targets::kReducescatter, kReducescatter);
KD_REGISTER(xla_targets::kBarrier, kBarrier);

}  // namespace
}  // namespace kerasdist::tf

// Asked by kerasdist/tensorflow/_native.py: this op library has the XLA
// kernels (a build with TF_XLA=0 lacks this file).
extern "C" __attribute__((visibility("default"))) int kerasdist_tf_xla_kernels(
    void) {
  return 1;
}

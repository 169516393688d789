// JAX front end on NVIDIA GPUs: the CUDA-platform handlers (bodies in
// jax/ffi_cuda_handlers.h, shared with TensorFlow's XLA kernels,
// tf/xla_ffi_cuda.cc), exported as the symbols that
// kerasdist/jax/_dispatch.py registers with JAX, so a jitted step on a GPU
// (Keras-on-JAX's train step) calls them on device memory. Built only with
// the core's GPU backend (KERASDIST_WITH_NCCL).

#include "jax/ffi_cuda_handlers.h"

namespace jc = kerasdist::jax_ffi_cuda;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllreduceCuda, jc::AllreduceImpl,
                              jc::AllreduceBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistGroupedAllreduceCuda,
                              jc::GroupedAllreduceImpl,
                              jc::GroupedAllreduceBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBroadcastCuda, jc::BroadcastImpl,
                              jc::BroadcastBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBarrierCuda, jc::BarrierImpl,
                              jc::BarrierBinding());

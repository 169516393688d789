// JAX front end: the collectives as XLA FFI handlers (custom calls), so they
// run inside jax.jit. The handler bodies are in jax/ffi_handlers.h, shared
// with TensorFlow's XLA kernels (tf/xla_ffi.cc); here they are compiled
// against jaxlib's XLA FFI headers and exported as the symbols that
// kerasdist/jax/_dispatch.py registers with JAX.

#include "jax/ffi_handlers.h"

namespace jf = kerasdist::jax_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllreduce, jf::AllreduceImpl,
                              jf::AllreduceBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistGroupedAllreduce,
                              jf::GroupedAllreduceImpl,
                              jf::GroupedAllreduceBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAllgather, jf::AllgatherImpl,
                              jf::AllgatherBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBroadcast, jf::BroadcastImpl,
                              jf::BroadcastBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistAlltoall, jf::AlltoallImpl,
                              jf::AlltoallBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistReducescatter, jf::ReducescatterImpl,
                              jf::ReducescatterBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasdistBarrier, jf::BarrierImpl,
                              jf::BarrierBinding());

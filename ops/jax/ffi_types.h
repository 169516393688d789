// What the CPU and CUDA handlers share: XLA's element types as the core's.
#ifndef KERASDIST_OPS_JAX_FFI_TYPES_H_
#define KERASDIST_OPS_JAX_FFI_TYPES_H_

#include <cstdint>

#include "core/types.h"
#include "xla/ffi/api/ffi.h"

namespace kerasdist::jax_ffi {

// The core's DataType code of an XLA element type; false for a type the
// core does not take.
inline bool ToCore(xla::ffi::DataType t, int32_t* out) {
  using kerasdist::core::DataType;
  namespace ffi = xla::ffi;
  DataType d;
  switch (t) {
    case ffi::DataType::F16: d = DataType::kFloat16; break;
    case ffi::DataType::BF16: d = DataType::kBFloat16; break;
    case ffi::DataType::F32: d = DataType::kFloat32; break;
    case ffi::DataType::F64: d = DataType::kFloat64; break;
    case ffi::DataType::S32: d = DataType::kInt32; break;
    case ffi::DataType::S64: d = DataType::kInt64; break;
    case ffi::DataType::U8: d = DataType::kUInt8; break;
    case ffi::DataType::PRED: d = DataType::kBool; break;
    default: return false;
  }
  *out = static_cast<int32_t>(d);
  return true;
}

}  // namespace kerasdist::jax_ffi

#endif  // KERASDIST_OPS_JAX_FFI_TYPES_H_

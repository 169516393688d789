// What the CPU and CUDA handlers share: XLA's element types as the core's,
// the parts of a request that differ between the collectives, and the
// request built from them.
#ifndef KERASDIST_OPS_JAX_FFI_COMMON_H_
#define KERASDIST_OPS_JAX_FFI_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/c_api.h"
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
    case ffi::DataType::F16:
      d = DataType::kFloat16;
      break;
    case ffi::DataType::BF16:
      d = DataType::kBFloat16;
      break;
    case ffi::DataType::F32:
      d = DataType::kFloat32;
      break;
    case ffi::DataType::F64:
      d = DataType::kFloat64;
      break;
    case ffi::DataType::S32:
      d = DataType::kInt32;
      break;
    case ffi::DataType::S64:
      d = DataType::kInt64;
      break;
    case ffi::DataType::U8:
      d = DataType::kUInt8;
      break;
    case ffi::DataType::PRED:
      d = DataType::kBool;
      break;
    case ffi::DataType::S8:
      d = DataType::kInt8;
      break;
    case ffi::DataType::S16:
      d = DataType::kInt16;
      break;
    case ffi::DataType::U16:
      d = DataType::kUInt16;
      break;
    default:
      return false;
  }
  *out = static_cast<int32_t>(d);
  return true;
}

// The parts of a request that differ between the collectives.
struct Spec {
  kerasdist::core::OpType op = kerasdist::core::OpType::kAllreduce;
  int32_t reduce_op = 1;
  int32_t root_rank = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::string group;
  int32_t group_size = 0;
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank
  int32_t process_set = 0;      // the set traced with (0: the whole job)
};

// An allreduce's (or reducescatter's) spec.
inline Spec ReduceSpec(kerasdist::core::OpType op, int32_t reduce_op,
                       double prescale, double postscale) {
  Spec s;
  s.op = op;
  s.reduce_op = reduce_op;
  s.prescale = prescale;
  s.postscale = postscale;
  return s;
}

// The request for one tensor; `name`, `s` and `shape` must outlive it.
inline kerasdist_request Request(const std::string& name, const Spec& s,
                                 int32_t dtype,
                                 const std::vector<int64_t>& shape,
                                 int32_t device) {
  kerasdist_request r{};
  r.name = name.c_str();
  r.op = static_cast<int32_t>(s.op);
  r.reduce_op = s.reduce_op;
  r.dtype = dtype;
  r.ndim = static_cast<int32_t>(shape.size());
  r.shape = shape.data();
  r.root_rank = s.root_rank;
  r.prescale = s.prescale;
  r.postscale = s.postscale;
  r.nsplits = static_cast<int32_t>(s.splits.size());
  r.splits = s.splits.data();
  r.group = s.group.c_str();
  r.group_size = s.group_size;
  r.device = device;
  r.process_set = s.process_set;
  return r;
}

}  // namespace kerasdist::jax_ffi

#endif  // KERASDIST_OPS_JAX_FFI_COMMON_H_

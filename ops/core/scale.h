// Element-wise helpers of the data path: copy with a scale factor (prescale,
// postscale, 1/size for Average) in one pass over the buffer.
#ifndef KERASDIST_CORE_SCALE_H_
#define KERASDIST_CORE_SCALE_H_

#include <cstdint>

#include "types.h"

namespace kerasdist::core {

// How a reduction runs on the wire: Average becomes Sum followed by a
// postscale of 1/size (floats) or a truncating division by size (integers).
struct Scaling {
  ReduceOp op;
  double post;
  int64_t divisor = 1;
};
Scaling AverageAsSum(ReduceOp op, DataType dt, double postscale, int size);

// dst[i] = src[i] * factor (dst may equal src). Integer types, as Horovod:
// the product in double, truncated toward zero (7 x 0.5 = 3, -7 x 0.5 = -3);
// with `int_divisor` > 1 (how Average treats integers) src[i] * factor /
// int_divisor, truncated, and for factor 1 exactly C's division.
void ScaleCopy(void* dst, const void* src, int64_t count, DataType dt,
               double factor, int64_t int_divisor = 1);

// out[i] = a[i] (op) b[i] for Sum, Min, Max and Product (not Average);
// `out` may be `a` or `b`. 16-bit floats are computed in float and rounded
// once. Integers wrap, as in MPI.
void Combine(void* out, const void* a, const void* b, int64_t count,
             DataType dt, ReduceOp op);

// Combine, then ScaleCopy(out, out, count, dt, factor, int_divisor), with the
// same result bit for bit; for float32 and float64 in one pass over `out`.
void CombineScaled(void* out, const void* a, const void* b, int64_t count,
                   DataType dt, ReduceOp op, double factor,
                   int64_t int_divisor = 1);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_SCALE_H_

// Bulk float16 / bfloat16 arithmetic for the data path: the MPI reduction
// function of 16-bit floats (MPI has none) and scaling (Average, pre- and
// postscale). The scalar conversions in half.h cost ~15 ns an element; these
// convert in chunks, with F16C / AVX2 where the CPU has them (checked at run
// time), and give the same bits as the scalar code (NaN payloads aside).
#ifndef KERASDIST_CORE_HALF_KERNELS_H_
#define KERASDIST_CORE_HALF_KERNELS_H_

#include <cstdint>

#include "types.h"

namespace kerasdist::core {

// How the conversions run: kAuto picks the fastest the CPU supports; the
// others exist so that tests can check both paths on one machine.
enum class Simd { kAuto, kScalar };

// `dt` is kFloat16 or kBFloat16.
void Widen16(DataType dt, const uint16_t* in, float* out, int64_t n,
             Simd simd = Simd::kAuto);
void Narrow16(DataType dt, const float* in, uint16_t* out, int64_t n,
              Simd simd = Simd::kAuto);

// out[i] = a[i] (op) b[i], computed in float, rounded once; `out` may be
// `a` or `b`.
void Reduce16(DataType dt, ReduceOp op, const uint16_t* a, const uint16_t* b,
              uint16_t* out, int64_t n);
// dst[i] = src[i] * factor, computed in float (dst may equal src).
void Scale16(DataType dt, uint16_t* dst, const uint16_t* src, int64_t n,
             float factor);

// Whether kAuto uses the vector instructions on this CPU.
bool Simd16Available();

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_HALF_KERNELS_H_

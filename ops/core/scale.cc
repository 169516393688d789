#include "scale.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "half_kernels.h"

namespace kerasdist::core {

namespace {

template <typename T>
void ScaleFloat(T* dst, const T* src, int64_t n, double factor) {
  const T f = static_cast<T>(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * f;
}

// x (an integer times a factor) as T, truncated toward zero as C++ converts
// (Horovod's integer scaling); beyond int64 it saturates, beyond a smaller
// type it wraps, as through int64.
template <typename T>
T TruncateTo(double x) {
  constexpr double kLimit = 9223372036854775807.0;  // 2^63
  int64_t v;
  if (x >= kLimit) {
    v = std::numeric_limits<int64_t>::max();
  } else if (x <= -kLimit) {
    v = std::numeric_limits<int64_t>::min();
  } else {
    v = static_cast<int64_t>(x);
  }
  return static_cast<T>(v);
}

// Integers: with `factor` 1, a division by `div` truncating toward zero (C
// division, exact); otherwise, as Horovod, the value times factor / div in
// double, truncated toward zero: 7 x 0.5 = 3, -7 x 0.5 = -3.
template <typename T>
void ScaleInt(T* dst, const T* src, int64_t n, double factor, int64_t div) {
  if (factor == 1.0) {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = static_cast<T>(static_cast<int64_t>(src[i]) / div);
    return;
  }
  const double f = div > 1 ? factor / static_cast<double>(div) : factor;
  for (int64_t i = 0; i < n; ++i)
    dst[i] = TruncateTo<T>(static_cast<double>(src[i]) * f);
}

// Integers add and multiply as unsigned (at least unsigned int, since a
// narrower unsigned type would be promoted to int): they wrap, as in MPI,
// instead of overflowing (undefined in C++).
template <typename T>
auto Wide(T v) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    if constexpr (sizeof(T) < sizeof(unsigned)) {
      return static_cast<unsigned>(static_cast<U>(v));
    } else {
      return static_cast<U>(v);
    }
  } else {
    return v;
  }
}

// Blocks of 16 with a constant trip count, so that -O2 vectorises them.
template <typename T, typename F>
void Elementwise(void* out_v, const void* a_v, const void* b_v, int64_t n,
                 F f) {
  T* out = static_cast<T*>(out_v);
  const T* a = static_cast<const T*>(a_v);
  const T* b = static_cast<const T*>(b_v);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) out[i + j] = f(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) out[i] = f(a[i], b[i]);
}

template <typename T>
void CombineTyped(void* out, const void* a, const void* b, int64_t n,
                  ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      Elementwise<T>(out, a, b, n, [](T x, T y) { return y < x ? y : x; });
      break;
    case ReduceOp::kMax:
      Elementwise<T>(out, a, b, n, [](T x, T y) { return y > x ? y : x; });
      break;
    case ReduceOp::kProduct:
      Elementwise<T>(out, a, b, n, [](T x, T y) {
        return static_cast<T>(Wide<T>(x) * Wide<T>(y));
      });
      break;
    default:
      Elementwise<T>(out, a, b, n, [](T x, T y) {
        return static_cast<T>(Wide<T>(x) + Wide<T>(y));
      });
      break;
  }
}

}  // namespace

void Combine(void* out, const void* a, const void* b, int64_t count,
             DataType dt, ReduceOp op) {
  switch (dt) {
    case DataType::kFloat32:
      CombineTyped<float>(out, a, b, count, op);
      break;
    case DataType::kFloat64:
      CombineTyped<double>(out, a, b, count, op);
      break;
    case DataType::kInt32:
      CombineTyped<int32_t>(out, a, b, count, op);
      break;
    case DataType::kInt64:
      CombineTyped<int64_t>(out, a, b, count, op);
      break;
    case DataType::kUInt8:
    case DataType::kBool:
      CombineTyped<uint8_t>(out, a, b, count, op);
      break;
    case DataType::kInt8:
      CombineTyped<int8_t>(out, a, b, count, op);
      break;
    case DataType::kInt16:
      CombineTyped<int16_t>(out, a, b, count, op);
      break;
    case DataType::kUInt16:
      CombineTyped<uint16_t>(out, a, b, count, op);
      break;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      Reduce16(dt, op, static_cast<const uint16_t*>(a),
               static_cast<const uint16_t*>(b), static_cast<uint16_t*>(out),
               count);
      break;
  }
}

void CombineScaled(void* out, const void* a, const void* b, int64_t count,
                   DataType dt, ReduceOp op, double factor,
                   int64_t int_divisor) {
  // The sum is rounded to T before the product, as in the two passes.
  if (op == ReduceOp::kSum && factor != 1.0 && dt == DataType::kFloat32) {
    const float f = static_cast<float>(factor);
    Elementwise<float>(out, a, b, count,
                       [f](float x, float y) { return (x + y) * f; });
    return;
  }
  if (op == ReduceOp::kSum && factor != 1.0 && dt == DataType::kFloat64) {
    Elementwise<double>(out, a, b, count, [factor](double x, double y) {
      return (x + y) * factor;
    });
    return;
  }
  // Otherwise two passes, piece by piece while the piece is in cache.
  constexpr int64_t kPiece = 4096;
  const int64_t es = DataTypeSize(dt);
  for (int64_t i = 0; i < count; i += kPiece) {
    const int64_t m = std::min(kPiece, count - i);
    char* o = static_cast<char*>(out) + i * es;
    Combine(o, static_cast<const char*>(a) + i * es,
            static_cast<const char*>(b) + i * es, m, dt, op);
    ScaleCopy(o, o, m, dt, factor, int_divisor);  // nothing to do for 1
  }
}

Scaling AverageAsSum(ReduceOp op, DataType dt, double postscale, int size) {
  Scaling s{op, postscale, 1};
  if (op == ReduceOp::kAverage) {
    s.op = ReduceOp::kSum;
    if (IsFloating(dt)) {
      s.post /= size;
    } else {
      s.divisor = size;
    }
  }
  return s;
}

void ScaleCopy(void* dst, const void* src, int64_t count, DataType dt,
               double factor, int64_t int_divisor) {
  bool is_int = !IsFloating(dt);
  if (factor == 1.0 && (!is_int || int_divisor <= 1)) {
    if (dst != src && count > 0)
      std::memmove(dst, src, count * DataTypeSize(dt));
    return;
  }
  switch (dt) {
    case DataType::kFloat32:
      ScaleFloat(static_cast<float*>(dst), static_cast<const float*>(src),
                 count, factor);
      break;
    case DataType::kFloat64:
      ScaleFloat(static_cast<double*>(dst), static_cast<const double*>(src),
                 count, factor);
      break;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      Scale16(dt, static_cast<uint16_t*>(dst),
              static_cast<const uint16_t*>(src), count,
              static_cast<float>(factor));
      break;
    case DataType::kInt32:
      ScaleInt(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src),
               count, factor, int_divisor);
      break;
    case DataType::kInt64:
      ScaleInt(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src),
               count, factor, int_divisor);
      break;
    case DataType::kUInt8:
    case DataType::kBool:
      ScaleInt(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
               count, factor, int_divisor);
      break;
    case DataType::kInt8:
      ScaleInt(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src),
               count, factor, int_divisor);
      break;
    case DataType::kInt16:
      ScaleInt(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src),
               count, factor, int_divisor);
      break;
    case DataType::kUInt16:
      ScaleInt(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src),
               count, factor, int_divisor);
      break;
  }
}

}  // namespace kerasdist::core

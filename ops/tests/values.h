// Test data and the tests' own reading and writing of every dtype, kept
// apart from the core's conversions so that results are checked against an
// independent truth: values are small integers (and halves), exact in every
// dtype, encoded and decoded here with plain bit arithmetic.
#ifndef KERASDIST_OPS_TESTS_VALUES_H_
#define KERASDIST_OPS_TESTS_VALUES_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../core/types.h"
#include "harness.h"

namespace kdtest {

using kerasdist::core::DataType;

inline uint32_t FloatBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

// Exactly representable values only (checked).
inline uint16_t EncodeHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  if ((x & 0x7fffffffu) == 0) return sign;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  CHECK_MSG(exp > 0 && exp < 31 && (x & 0x1fffu) == 0,
            "not exact in float16: " + std::to_string(f));
  return static_cast<uint16_t>(sign | exp << 10 | ((x >> 13) & 0x3ffu));
}

inline double DecodeHalf(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v =
      exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  CHECK_MSG(exp != 31, "float16 inf or nan");
  return (h & 0x8000u) ? -v : v;
}

inline uint16_t EncodeBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  CHECK_MSG((x & 0xffffu) == 0, "not exact in bfloat16: " + std::to_string(f));
  return static_cast<uint16_t>(x >> 16);
}

inline double DecodeBFloat16(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline int64_t Size(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
    case DataType::kUInt16:
      return 2;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    default:
      return 1;
  }
}

inline void Put(std::vector<char>& buf, int64_t i, DataType dt, double v) {
  char* p = buf.data() + i * Size(dt);
  switch (dt) {
    case DataType::kFloat16: {
      const uint16_t h = EncodeHalf(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kBFloat16: {
      const uint16_t h = EncodeBFloat16(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kFloat32: {
      float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DataType::kFloat64:
      std::memcpy(p, &v, 8);
      break;
    case DataType::kInt32: {
      int32_t x = static_cast<int32_t>(v);
      std::memcpy(p, &x, 4);
      break;
    }
    case DataType::kInt64: {
      int64_t x = static_cast<int64_t>(v);
      std::memcpy(p, &x, 8);
      break;
    }
    case DataType::kInt8: {
      const int8_t x = static_cast<int8_t>(static_cast<int64_t>(v));
      std::memcpy(p, &x, 1);
      break;
    }
    case DataType::kInt16: {
      const int16_t x = static_cast<int16_t>(static_cast<int64_t>(v));
      std::memcpy(p, &x, 2);
      break;
    }
    case DataType::kUInt16: {
      const uint16_t x = static_cast<uint16_t>(static_cast<int64_t>(v));
      std::memcpy(p, &x, 2);
      break;
    }
    default: {
      const uint8_t x = static_cast<uint8_t>(static_cast<int64_t>(v) & 0xff);
      std::memcpy(p, &x, 1);
      break;
    }
  }
}

inline double Get(const std::vector<char>& buf, int64_t i, DataType dt) {
  const char* p = buf.data() + i * Size(dt);
  uint16_t h;
  switch (dt) {
    case DataType::kFloat16:
      std::memcpy(&h, p, 2);
      return DecodeHalf(h);
    case DataType::kBFloat16:
      std::memcpy(&h, p, 2);
      return DecodeBFloat16(h);
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DataType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DataType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DataType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
    case DataType::kInt8:
      return static_cast<int8_t>(*p);
    case DataType::kInt16: {
      int16_t x;
      std::memcpy(&x, p, 2);
      return x;
    }
    case DataType::kUInt16: {
      uint16_t x;
      std::memcpy(&x, p, 2);
      return x;
    }
    default:
      return static_cast<uint8_t>(*p);
  }
}

inline bool IsFloat(DataType dt) {
  return dt == DataType::kFloat16 || dt == DataType::kBFloat16 ||
         dt == DataType::kFloat32 || dt == DataType::kFloat64;
}

// A small value that differs by rank, tensor and element: in [-3, 3], or
// [0, 6] for unsigned types ([0, 1] for bool).
inline double Value(int rank, int tensor, int64_t i, DataType dt) {
  const int64_t k = (rank + 1) * 3 + tensor * 5 + i * 7;
  if (dt == DataType::kBool) return static_cast<double>(k % 2);
  if (dt == DataType::kUInt8 || dt == DataType::kUInt16)
    return static_cast<double>(k % 7);
  return static_cast<double>(k % 7 - 3);
}

}  // namespace kdtest

#endif  // KERASDIST_OPS_TESTS_VALUES_H_

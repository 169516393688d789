// float16 / bfloat16 <-> float conversion (round to nearest even), used for
// scaling and for the MPI reduction functions of 16-bit floats, which MPI
// does not provide.
#ifndef KERASDIST_CORE_HALF_H_
#define KERASDIST_CORE_HALF_H_

#include <cstdint>
#include <cstring>

namespace kerasdist::core {

inline float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 |
             (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (abs > 0x7f800000u ? 0x200u : 0));
  }
  if (abs >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // overflow
  if (abs < 0x38800000u) {                         // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... places m into 10 bits
    uint32_t half_m = m >> (shift);
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half_m & 1))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x40);
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_HALF_H_

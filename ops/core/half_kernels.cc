#include "half_kernels.h"

#include <algorithm>

#include "half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KD_X86_SIMD 1
#endif

namespace kerasdist::core {

namespace {

// Elements converted at a time: the float copies live on the stack.
constexpr int64_t kChunk = 512;

bool DetectSimd() {
#ifdef KD_X86_SIMD
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const bool kHaveSimd = DetectSimd();

void WidenScalar(DataType dt, const uint16_t* in, float* out, int64_t n) {
  if (dt == DataType::kFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(in[i]);
  }
}

void NarrowScalar(DataType dt, const float* in, uint16_t* out, int64_t n) {
  if (dt == DataType::kFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToBFloat16(in[i]);
  }
}

#ifdef KD_X86_SIMD

// Eight elements at a time; the scalar code does the tail.
__attribute__((target("avx2,f16c"))) int64_t WidenSimd(DataType dt,
                                                       const uint16_t* in,
                                                       float* out, int64_t n) {
  int64_t i = 0;
  if (dt == DataType::kFloat16) {
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16);
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(w));
    }
  }
  return i;
}

__attribute__((target("avx2,f16c"))) int64_t NarrowSimd(DataType dt,
                                                        const float* in,
                                                        uint16_t* out,
                                                        int64_t n) {
  int64_t i = 0;
  if (dt == DataType::kFloat16) {
    // Round to nearest even, like FloatToHalf; overflow gives infinity.
    for (; i + 8 <= n; i += 8) {
      __m128i h =
          _mm256_cvtps_ph(_mm256_loadu_ps(in + i),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    }
  } else {
    // FloatToBFloat16 on eight lanes: add 0x7fff plus the kept lowest bit,
    // keep the top half; NaNs keep their top bits and become quiet.
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
      __m256i x = _mm256_castps_si256(_mm256_loadu_ps(in + i));
      __m256i top = _mm256_srli_epi32(x, 16);
      __m256i lsb = _mm256_and_si256(top, one);
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(x, bias), lsb), 16);
      __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
      r = _mm256_blendv_epi8(r, _mm256_or_si256(top, quiet), nan);
      // Eight 32-bit lanes (each < 2^16) to eight 16-bit values.
      __m256i packed =
          _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_castsi256_si128(packed));
    }
  }
  return i;
}

#endif  // KD_X86_SIMD

}  // namespace

bool Simd16Available() { return kHaveSimd; }

void Widen16(DataType dt, const uint16_t* in, float* out, int64_t n,
             Simd simd) {
  int64_t done = 0;
#ifdef KD_X86_SIMD
  if (simd == Simd::kAuto && kHaveSimd) done = WidenSimd(dt, in, out, n);
#endif
  WidenScalar(dt, in + done, out + done, n - done);
}

void Narrow16(DataType dt, const float* in, uint16_t* out, int64_t n,
              Simd simd) {
  int64_t done = 0;
#ifdef KD_X86_SIMD
  if (simd == Simd::kAuto && kHaveSimd) done = NarrowSimd(dt, in, out, n);
#endif
  NarrowScalar(dt, in + done, out + done, n - done);
}

void Reduce16(DataType dt, ReduceOp op, const uint16_t* x, const uint16_t* y,
              uint16_t* out, int64_t n) {
  float a[kChunk], b[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    Widen16(dt, x + i, a, m);
    Widen16(dt, y + i, b, m);
    switch (op) {
      case ReduceOp::kMin:
        for (int64_t j = 0; j < m; ++j) b[j] = a[j] < b[j] ? a[j] : b[j];
        break;
      case ReduceOp::kMax:
        for (int64_t j = 0; j < m; ++j) b[j] = a[j] > b[j] ? a[j] : b[j];
        break;
      case ReduceOp::kProduct:
        for (int64_t j = 0; j < m; ++j) b[j] = a[j] * b[j];
        break;
      default:  // Sum (Average runs as Sum)
        for (int64_t j = 0; j < m; ++j) b[j] = a[j] + b[j];
        break;
    }
    Narrow16(dt, b, out + i, m);
  }
}

void Scale16(DataType dt, uint16_t* dst, const uint16_t* src, int64_t n,
             float factor) {
  float a[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    Widen16(dt, src + i, a, m);
    for (int64_t j = 0; j < m; ++j) a[j] *= factor;
    Narrow16(dt, a, dst + i, m);
  }
}

}  // namespace kerasdist::core

// What the kernels share: widening a stored value to float32, rounding as a dtype rounds, and exp in a form loops
// vectorize.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SWITCHYARD_BF16_ROWS 1
#include <immintrin.h>
#endif

namespace switchyard_cpu {

// float from a stored value: a bfloat16 is the high half of a float (a shift the compiler vectorizes)
inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(c10::Half x) { return static_cast<float>(x); }

// bfloat16 bits of x, rounded to nearest even as torch rounds (NaN stays NaN), branch-free so that loops vectorize
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : static_cast<uint16_t>(rounded);
}

// x rounded to the dtype of the tag (as a torch op's result in that dtype), kept as a float
inline float round_to(float x, c10::BFloat16) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float round_to(float x, c10::Half) { return widen(static_cast<c10::Half>(x)); }
inline float round_to(float x, float) { return x; }
inline float round_to(float x, double) { return x; }

// x stored in the dtype (rounded as torch rounds)
inline void store(float* p, float x) { *p = x; }
inline void store(double* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { p->x = bf16_bits(x); }
inline void store(c10::Half* p, float x) { *p = static_cast<c10::Half>(x); }

// A row of floats rounded to a dtype in place (`round_row`), or stored into it (`store_row`), as round_to and
// store round. Where the CPU converts to bf16 natively, a bf16 row takes one instruction per 16 values (the
// integer rounding above is six); a NaN stays a NaN, its payload the instruction's.
template <typename T>
inline void round_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_to(x[i], T());
}

template <typename T>
inline void store_row(T* dst, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(dst + i, x[i]);
}

#if SWITCHYARD_BF16_ROWS
template <>
inline void round_row<c10::BFloat16>(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm512_storeu_ps(x + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
  for (; i < n; ++i) x[i] = round_to(x[i], c10::BFloat16());
}

template <>
inline void store_row<c10::BFloat16>(c10::BFloat16* dst, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  }
  for (; i < n; ++i) store(dst + i, x[i]);
}
#endif

// e^x for x <= 0 (scores minus their maximum), within a few ulp of expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// its Taylor polynomial to degree 7, 2^n into the exponent bits; below -87 it is e^-87 (~1e-38). Branch-free so
// that loops of it vectorize (libm's expf is a call per value); always inlined, since a loop that calls it does
// not vectorize.
[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Σ x[i]^2 summed in the order of torch's sum over a contiguous row, so that a norm rounds as torch's does whatever
// the compiler's vector width: ATen's vectorized inner sum (SumKernel.cpp) as x86 dispatches it, in AVX2 vectors of
// 8 lanes even on AVX512 CPUs (the kernel has no AVX512 registration): the vectors are dealt round-robin to 4
// accumulators, which carry into 3 more levels every 2^p of their rows (p = max(4, ceil(log2 rows) / 4)); the
// vectors left over go to the first, the 4 are added in order, then the scalar tail and the 8 lanes one by one.
inline float sum_squares(const float* x, int64_t n) {
  constexpr int64_t LANES = 8, ILP = 4, LEVELS = 4;
  const int64_t vectors = n / LANES, rows = vectors / ILP;
  int64_t log2 = 0;
  while ((int64_t{1} << log2) < rows) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / LEVELS), step = int64_t{1} << power, mask = step - 1;
  float acc[LEVELS][ILP][LANES] = {};
  auto add_row = [&](int64_t row) {
    for (int64_t k = 0; k < ILP; ++k) {
      const float* v = x + (row * ILP + k) * LANES;
      for (int64_t l = 0; l < LANES; ++l) acc[0][k][l] += v[l] * v[l];
    }
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int64_t level = 1; level < LEVELS; ++level) {
      for (int64_t k = 0; k < ILP; ++k) {
        for (int64_t l = 0; l < LANES; ++l) {
          acc[level][k][l] += acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.f;
        }
      }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t level = 1; level < LEVELS; ++level) {
    for (int64_t k = 0; k < ILP; ++k) {
      for (int64_t l = 0; l < LANES; ++l) acc[0][k][l] += acc[level][k][l];
    }
  }
  for (int64_t v = rows * ILP; v < vectors; ++v) {
    for (int64_t l = 0; l < LANES; ++l) acc[0][0][l] += x[v * LANES + l] * x[v * LANES + l];
  }
  for (int64_t k = 1; k < ILP; ++k) {
    for (int64_t l = 0; l < LANES; ++l) acc[0][0][l] += acc[0][k][l];
  }
  float total = 0.f;
  for (int64_t e = vectors * LANES; e < n; ++e) total += x[e] * x[e];
  for (int64_t l = 0; l < LANES; ++l) total += acc[0][0][l];
  return total;
}

// 1 / sqrt(mean(x^2) + eps): RMSNorm's factor for a row of n floats, as torch computes it
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
}

}  // namespace switchyard_cpu

// Vectors of float, bfloat16 or half widened to fp32 and rounded back, W (= Vectorized<float>'s
// width) elements at a time, with ATen's vector conversions: a 16-bit row is converted in
// registers, not element by element (which made the element-wise kernels several times slower
// on bfloat16 than on float32). Rounding is round-to-nearest-even, as c10::BFloat16 and
// c10::Half round a float; bfloat16 is rounded in float's own bits (round_bfloat16), with the
// bits ATen's conversion gives.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace widen {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

template <typename T>
inline Vec load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (at::is_reduced_floating_point_v<T>) {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  } else {  // double (the ops accept it; no model runs in it): element by element
    float buffer[W];
    for (int64_t j = 0; j < W; ++j) buffer[j] = static_cast<float>(p[j]);
    return Vec::loadu(buffer);
  }
}

inline Vec round_bfloat16(const Vec& v);
inline void store_bfloat16(at::BFloat16* p, const Vec& v);

template <typename T>
inline void store(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    store_bfloat16(p, v);
  } else if constexpr (at::is_reduced_floating_point_v<T>) {
    at::vec::convert_from_float<T>(v, v).store(p, W);
  } else {
    float buffer[W];
    v.store(buffer);
    for (int64_t j = 0; j < W; ++j) p[j] = static_cast<T>(buffer[j]);
  }
}

// v rounded to bfloat16 and widened again, in float's own bits: bfloat16 is a float's upper
// half, so rounding clears the lower half, nearest even, and a NaN becomes the one ATen's
// conversion makes (0xffff): the bits of ATen's round trip (below) in a third of its
// instructions, with no packing to 16-bit lanes and back (SiLU-and-mul on bfloat16 spent more
// time converting than computing).
inline Vec round_bfloat16(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __m512i upper = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return Vec(_mm512_castsi512_ps(
      _mm512_mask_blend_epi32(ordered, upper, _mm512_and_si512(sum, upper))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i upper = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
  return Vec(_mm256_blendv_ps(_mm256_castsi256_ps(upper),
                              _mm256_castsi256_ps(_mm256_and_si256(sum, upper)), ordered));
#else
  return std::get<0>(
      at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(v, v)));
#endif
}

// v rounded to bfloat16 and stored: round_bfloat16's upper halves, narrowed to 16-bit lanes.
inline void store_bfloat16(at::BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i halves = _mm512_srli_epi32(_mm512_castps_si512(round_bfloat16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(halves));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i halves = _mm256_srli_epi32(_mm256_castps_si256(round_bfloat16(v)), 16);
  const __m256i packed = _mm256_packus_epi32(halves, halves);  // 128-bit lanes: lo lo, hi hi
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, W);
#endif
}

// v rounded to T and widened again: the value a separate torch op in dtype T would hand on.
template <typename T>
inline Vec round(const Vec& v) {
  if constexpr (!at::is_reduced_floating_point_v<T>) {
    return v;  // float, or double (whose values in float are already rounded)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return round_bfloat16(v);
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

}  // namespace widen

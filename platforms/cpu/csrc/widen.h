// Vectors of float, bfloat16 or half widened to fp32 and rounded back, W (= Vectorized<float>'s
// width) elements at a time, with ATen's vector conversions: a 16-bit row is converted in
// registers, not element by element (which made the element-wise kernels several times slower
// on bfloat16 than on float32). Rounding is round-to-nearest-even, as c10::BFloat16 and
// c10::Half round a float.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

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

template <typename T>
inline void store(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else if constexpr (at::is_reduced_floating_point_v<T>) {
    at::vec::convert_from_float<T>(v, v).store(p, W);
  } else {
    float buffer[W];
    v.store(buffer);
    for (int64_t j = 0; j < W; ++j) p[j] = static_cast<T>(buffer[j]);
  }
}

// v rounded to T and widened again: the value a separate torch op in dtype T would hand on.
template <typename T>
inline Vec round(const Vec& v) {
  if constexpr (!at::is_reduced_floating_point_v<T>) {
    return v;  // float, or double (whose values in float are already rounded)
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

}  // namespace widen

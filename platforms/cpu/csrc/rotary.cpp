// Rotary embedding (Llama/NeoX: the two halves of each head rotated) on query and key in place:
// x' = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the halves x1, x2.
//
// The arithmetic is HuggingFace's (octavo.ops.reference.rotary_embedding): cos and sin come in
// the activations' dtype, each product is rounded to that dtype, and so is their sum. No FMA:
// the products are kept apart from the add, so fp32 results are torch's to the bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <type_traits>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#include "widen.h"
#include "work_sharing.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// A rounded product the compiler may not fuse into the following add (-ffp-contract=fast
// would otherwise make x * c + y * s two FMAs, with one rounding fewer than torch's).
inline Vec product(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 raw = a * b;
#else
  __m256 raw = a * b;
#endif
  asm("" : "+v"(raw));
  return Vec(raw);
}

inline float product(float a, float b) {
  float p = a * b;
  asm("" : "+v"(p));
  return p;
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// One head of D elements: row[i] for i < D/2 pairs with row[i + D/2].
template <typename T>
inline void rotate_head(T* row, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const Vec x1 = widen::load(row + i), x2 = widen::load(row + half + i);
    const Vec first = widen::round<T>(product(x1, widen::load(cos + i))) -
                      widen::round<T>(product(x2, widen::load(sin + i)));
    const Vec second = widen::round<T>(product(x2, widen::load(cos + half + i))) +
                       widen::round<T>(product(x1, widen::load(sin + half + i)));
    widen::store(row + i, first);
    widen::store(row + half + i, second);
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(row[i]), x2 = static_cast<float>(row[half + i]);
    const float c1 = static_cast<float>(cos[i]), s1 = static_cast<float>(sin[i]);
    const float c2 = static_cast<float>(cos[half + i]), s2 = static_cast<float>(sin[half + i]);
    // -(x2 * s1) is the product of rotate_half's -x2 and s1, exactly.
    const float first = round_to<T>(product(x1, c1)) - round_to<T>(product(x2, s1));
    const float second = round_to<T>(product(x2, c2)) + round_to<T>(product(x1, s2));
    row[i] = static_cast<T>(first);
    row[half + i] = static_cast<T>(second);
  }
}

// query [T, H * D] and key [T, KVH * D] (rows may be strided: slices of the qkv projection),
// cos and sin [T, D] contiguous, all of one dtype. Rotates both in place.
void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.size(0) == key.size(0),
              "query and key must be [T, heads * head_dim] with one T");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && query.size(1) % head_dim == 0 &&
                  key.size(1) % head_dim == 0,
              "head_dim must be even and divide the query and key widths");
  TORCH_CHECK(query.stride(1) == 1 && key.stride(1) == 1, "query and key need contiguous rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == query.size(0) * head_dim && sin.numel() == cos.numel(),
              "cos and sin must be contiguous [T, head_dim]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "query, key, cos and sin must share a dtype");
  const int64_t tokens = query.size(0), D = head_dim;
  const int64_t q_heads = query.size(1) / D, k_heads = key.size(1) / D;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
        scalar_t* q = query.data_ptr<scalar_t>();
        scalar_t* k = key.data_ptr<scalar_t>();
        const scalar_t* c = cos.data_ptr<scalar_t>();
        const scalar_t* s = sin.data_ptr<scalar_t>();
        const int64_t qs = query.stride(0), ks = key.stride(0);
        // A grain of whole tokens: a decode batch's few rows stay on one thread.
        OCTAVO_CPU_NAMESPACE::parallel_chunks(tokens, 64, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const scalar_t* ct = c + t * D;
            const scalar_t* st = s + t * D;
            for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + t * qs + h * D, ct, st, D);
            for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + t * ks + h * D, ct, st, D);
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, int head_dim) "
      "-> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
}

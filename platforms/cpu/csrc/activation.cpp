// SiLU-and-multiply for the Llama MLP: out = silu(gate) * up in one pass over the activations.
//
// The arithmetic follows torch's (and so HuggingFace's): silu(x) = x / (1 + exp(-x)) in fp32;
// for 16-bit inputs silu's result is rounded to the input dtype before the product, and the
// product is rounded once more, as two separate torch ops would round.

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

inline Vec silu(const Vec& x) {
  const Vec one(1.f);
  return x / (one + x.neg().exp_u20());
}

template <typename T>
void silu_and_mul_rows(const T* gate, const T* up, T* out, int64_t n) {
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec s = widen::round<T>(silu(widen::load(gate + i)));
    widen::store(out + i, s * widen::load(up + i));
  }
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    float s = g / (1.f + std::exp(-g));
    if constexpr (!std::is_same_v<T, float>) s = static_cast<float>(static_cast<T>(s));
    out[i] = static_cast<T>(s * static_cast<float>(up[i]));
  }
}

// out[T, I] = silu(gate[T, I]) * up[T, I]; rows may be strided, elements within a row not.
void silu_and_mul(at::Tensor out, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && out.sizes() == gate.sizes(),
              "gate, up and out must be [T, I] of one shape");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1 && out.stride(1) == 1,
              "silu_and_mul needs contiguous rows");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() && out.scalar_type() == gate.scalar_type(),
              "gate, up and out must share a dtype");
  const int64_t rows = gate.size(0), n = gate.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_and_mul",
                                  [&] {
                                    const scalar_t* g = gate.data_ptr<scalar_t>();
                                    const scalar_t* u = up.data_ptr<scalar_t>();
                                    scalar_t* o = out.data_ptr<scalar_t>();
                                    const int64_t gs = gate.stride(0), us = up.stride(0),
                                                  os = out.stride(0);
                                    OCTAVO_CPU_NAMESPACE::parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
                                      for (int64_t r = begin; r < end; ++r) {
                                        silu_and_mul_rows(g + r * gs, u + r * us, o + r * os, n);
                                      }
                                    });
                                  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}

// RMSNorm with the residual add fused in front, one row per task: the sum and the sum of squares
// in one pass, the normalised product in a second, both over the row in registers.
//
// Rounding follows HuggingFace (octavo.ops.reference.rms_norm): the residual sum is rounded to
// the input dtype, statistics are fp32, the normalised value is rounded to the input dtype before
// the weight (of the same dtype) multiplies it, and the product is rounded once more.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#include "widen.h"
#include "work_sharing.h"

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// One row: summed = x (+ residual) rounded to T; out = weight * round(summed * inv_rms).
template <typename T>
void norm_row(const T* x, const T* residual, const T* weight, T* out, T* summed, int64_t n,
              float eps) {
  constexpr int64_t W = Vec::size();
  Vec squares(0.f);
  float tail = 0.f;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    Vec v = widen::load(x + i);
    if (residual != nullptr) {
      v = widen::round<T>(v + widen::load(residual + i));
      widen::store(summed + i, v);
    }
    squares = at::vec::fmadd(v, v, squares);
  }
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (residual != nullptr) {
      v = round_to<T>(v + static_cast<float>(residual[i]));
      summed[i] = static_cast<T>(v);
    }
    tail += v * v;
  }
  const float total =
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, squares) + tail;
  const float inv = 1.f / std::sqrt(total / static_cast<float>(n) + eps);
  const T* h = residual != nullptr ? summed : x;
  const Vec scale(inv);
  for (i = 0; i + W <= n; i += W) {
    const Vec normed = widen::round<T>(widen::load(h + i) * scale);
    widen::store(out + i, widen::load(weight + i) * normed);
  }
  for (; i < n; ++i) {
    const float normed = round_to<T>(static_cast<float>(h[i]) * inv);
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
  }
}

void check(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.is_contiguous(),
              name, " must be contiguous and shaped and typed like x");
}

// out = rms_norm(x (+ residual)) * weight; with residual, summed = x + residual. x, residual,
// out and summed are [T, H] contiguous; weight is [H]; all one dtype.
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& residual, c10::optional<at::Tensor> summed,
                   double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [T, H] and contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must be [H], contiguous, of x's dtype");
  check(out, x, "out");
  if (residual.has_value()) {
    check(*residual, x, "residual");
    TORCH_CHECK(summed.has_value(), "a residual needs a summed output");
    check(*summed, x, "summed");
  }
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = summed.has_value() ? summed->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    OCTAVO_CPU_NAMESPACE::parallel_chunks(rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row<scalar_t>(xp + r * n, rp ? rp + r * n : nullptr, wp, op + r * n,
                           sp ? sp + r * n : nullptr, n, static_cast<float>(eps));
      }
    });
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  rms_norm_impl(out, x, weight, c10::nullopt, c10::nullopt, eps);
}

void fused_add_rms_norm(at::Tensor out, at::Tensor summed, const at::Tensor& x,
                        const at::Tensor& residual, const at::Tensor& weight, double eps) {
  rms_norm_impl(out, x, weight, residual, summed, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  // Outputs are written in place and not returned: torch.compile cannot functionalise a custom
  // op whose result aliases an input.
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) out, Tensor(b!) summed, Tensor x, Tensor residual, "
      "Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
}

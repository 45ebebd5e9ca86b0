// Greedy sampling's argmax over each row of the logits, as torch.argmax(dim=-1) gives it: the
// first index of the row's maximum, or of its first NaN when it has one. torch's own reduction
// runs at ~3.5 GB/s on one thread here (1.2 ms for a [128, 8192] float32 decode batch); this one
// keeps, per vector lane, the largest value seen and where, in one pass. Two greedy steps are
// built on it: speculative decoding's all-greedy verification (greedy_verify) and greedy tokens
// straight from hidden states (greedy_tokens: a draft head's LM-head product and argmax).

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#include "own_kernels.h"
#include "work_sharing.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// Where the row's largest float32 value first is (its first NaN where it has one). Lane j sees
// the elements j, j + W, ...: a strict comparison keeps its first largest, and the smallest
// index among the lanes holding the row's largest is the first one in the row.
int64_t argmax_row(const float* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity()), best_at(0.f), nans(0.f);
  float lanes[W];
  for (int64_t j = 0; j < W; ++j) lanes[j] = static_cast<float>(j);
  Vec index_of = Vec::loadu(lanes);
  const Vec step(static_cast<float>(W));
  int64_t i = 0;
  for (; i + W <= n; i += W, index_of = index_of + step) {
    const Vec v = Vec::loadu(x + i);
    const Vec greater = v > best;
    best = Vec::blendv(best, v, greater);
    best_at = Vec::blendv(best_at, index_of, greater);
    nans = nans | (v != v);
  }
  float values[W], where[W], unordered[W];
  best.store(values);
  best_at.store(where);
  nans.store(unordered);
  bool any_nan = false;
  for (int64_t j = 0; j < W; ++j) any_nan |= unordered[j] != 0.f;
  for (int64_t t = i; t < n; ++t) any_nan |= std::isnan(x[t]);
  if (any_nan) {
    for (int64_t t = 0; t < n; ++t) {
      if (std::isnan(x[t])) return t;
    }
  }
  float top = x[0];
  int64_t index = 0, t = 1;
  if (i > 0) {  // else the row is shorter than a vector and the lanes saw nothing
    top = values[0];
    index = static_cast<int64_t>(where[0]);
    for (int64_t j = 1; j < W; ++j) {
      const int64_t here = static_cast<int64_t>(where[j]);
      if (values[j] > top || (values[j] == top && here < index)) {
        top = values[j];
        index = here;
      }
    }
    t = i;
  }
  for (; t < n; ++t) {
    if (x[t] > top) {
      top = x[t];
      index = t;
    }
  }
  return index;
}

template <typename T>
void argmax_of(const T* x, int64_t rows, int64_t n, int64_t* out) {
  OCTAVO_CPU_NAMESPACE::parallel_chunks(rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> widened;
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        out[r] = argmax_row(x + r * n, n);
      } else {  // exact: every bfloat16 / float16 value is a float32 one
        widened.resize(n);
        for (int64_t t = 0; t < n; ++t) widened[t] = static_cast<float>(x[r * n + t]);
        out[r] = argmax_row(widened.data(), n);
      }
    }
  });
}

void argmax_rows(at::Tensor out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "argmax_rows: logits must be a contiguous [R, V] tensor");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == logits.size(0),
              "argmax_rows: out must be int64 [R]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 24), "argmax_rows: rows of 1 to 2^24 - 1 values");
  int64_t* o = out.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat: return argmax_of<float>(logits.data_ptr<float>(), rows, n, o);
    case at::kBFloat16: return argmax_of<at::BFloat16>(logits.data_ptr<at::BFloat16>(), rows, n, o);
    case at::kHalf: return argmax_of<at::Half>(logits.data_ptr<at::Half>(), rows, n, o);
    default: TORCH_CHECK(false, "argmax_rows: float32, bfloat16 or float16 logits");
  }
}

// Greedy verification of drafts against the target's logits (every request greedy): request
// r has num_drafts[r] drafts, whose target rows are first_r + r .. first_r + r + k_r (first_r
// the drafts before r's, the last row the bonus position). Its drafts are kept while each is
// its row's argmax, then the argmax of the row after the last kept one follows; out [R, max_k +
// 1] gets them, -1 after. A row's argmax is taken only where it is read (up to the first
// rejection), so a rejected first draft costs one row, not k + 1.
void greedy_verify(at::Tensor out, const at::Tensor& logits, const at::Tensor& draft_token_ids,
                   const at::Tensor& num_drafts) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "greedy_verify: logits must be contiguous float32 [rows, V]");
  TORCH_CHECK(num_drafts.scalar_type() == at::kLong && num_drafts.dim() == 1 &&
                  num_drafts.is_contiguous(),
              "greedy_verify: num_drafts must be contiguous int64 [R]");
  TORCH_CHECK(draft_token_ids.scalar_type() == at::kLong && draft_token_ids.dim() == 1 &&
                  draft_token_ids.is_contiguous(),
              "greedy_verify: draft_token_ids must be contiguous int64 [sum(num_drafts)]");
  const int64_t R = num_drafts.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 24), "greedy_verify: rows of 1 to 2^24 - 1 values");
  const int64_t* k = num_drafts.data_ptr<int64_t>();
  int64_t total = 0, widest = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(k[r] >= 0, "greedy_verify: negative draft count");
    total += k[r];
    widest = std::max(widest, k[r]);
  }
  TORCH_CHECK(draft_token_ids.size(0) == total && logits.size(0) == total + R,
              "greedy_verify: ", total, " drafts of ", R, " requests need ", total + R,
              " logits rows and as many drafts; got ", logits.size(0), " rows, ",
              draft_token_ids.size(0), " drafts");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == R && out.size(1) == widest + 1,
              "greedy_verify: out must be contiguous int64 [R, max_k + 1]");
  const float* x = logits.data_ptr<float>();
  const int64_t* drafts = draft_token_ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  std::fill(o, o + R * (widest + 1), int64_t{-1});
  std::vector<int64_t> first(R, 0);  // the drafts before request r's
  for (int64_t r = 1; r < R; ++r) first[r] = first[r - 1] + k[r - 1];
  OCTAVO_CPU_NAMESPACE::parallel_chunks(R, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* d = drafts + first[r];
      const float* rows = x + (first[r] + r) * V;
      int64_t* row_out = o + r * (widest + 1);
      int64_t j = 0, best = argmax_row(rows, V);
      for (; j < k[r] && best == d[j]; ++j) {
        row_out[j] = d[j];
        best = argmax_row(rows + (j + 1) * V, V);
      }
      row_out[j] = best;
    }
  });
}

// out [M] = each row's argmax of hidden [M, K] @ W^T (W packed: pack_linear_weight, `vocab`
// rows): greedy tokens from hidden states, the LM-head product (the library's own GEMM) and the
// argmax in one call.
void greedy_tokens(at::Tensor out, const at::Tensor& hidden, const at::Tensor& lm_head_packed,
                   int64_t vocab) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat,
              "greedy_tokens: hidden states must be float32 [M, hidden]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == hidden.size(0),
              "greedy_tokens: out must be int64 [M]");
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 24), "greedy_tokens: 1 to 2^24 - 1 tokens");
  at::Tensor logits = at::empty({hidden.size(0), vocab}, hidden.options());
  own_kernels::kernels().linear.call(logits, hidden.contiguous(), lm_head_packed);
  argmax_of<float>(logits.data_ptr<float>(), hidden.size(0), vocab, out.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def("greedy_tokens(Tensor(a!) out, Tensor hidden, Tensor lm_head_packed, int vocab) -> ()");
  m.impl("greedy_tokens", c10::DispatchKey::CPU, &greedy_tokens);
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.def(
      "greedy_verify(Tensor(a!) out, Tensor logits, Tensor draft_token_ids, Tensor num_drafts) "
      "-> ()");
  m.impl("greedy_verify", c10::DispatchKey::CPU, &greedy_verify);
}

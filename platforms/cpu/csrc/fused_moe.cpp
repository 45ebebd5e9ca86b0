// A Mixture-of-Experts layer's experts in one call: a step's (token, choice) pairs grouped by
// expert, each used expert's gate/up product over its gathered rows, silu(gate) * up, its down
// product, and each token's weighted sum of its experts' outputs. The routing (scores, top-k,
// groups) is torch's, in octavo_cpu.fused_moe; this op takes its result.
//
// The products are the platform's GEMM (gemm.cpp's `linear`, called through the dispatcher as
// own_kernels.h gives it) over each expert's weights packed once at load by pack_linear_weight
// (a float32 model) or pack_linear_weight_bf16 (a bfloat16 model), stacked per expert:
// w13_packed [E, P13, H, NR] (gate rows then up rows, 2I outputs), w2_packed [E, P2, I, NR].
//
// The numbers follow the reference (octavo.ops.reference.fused_moe) op by op: the rows widened
// to float32, each product summed in float32 and rounded to the model dtype, silu's result and
// the product with up rounded as two torch ops round them, the down product rounded, times the
// token's weight (rounded to the model dtype) rounded, and added into the token's output in
// ascending expert order from zero, each sum rounded. For float32 the roundings are no-ops.
//
// Batch invariance: a row's GEMM result is one fixed chain of FMAs whatever rows share its tile
// (gemm.cpp), the activation and the sum are element-wise in a fixed order, so a token's output
// does not depend on the other tokens of the step, nor on the thread count.
//
// Work: pairs in items of up to kItemRows rows of one expert (an item runs gather, gate/up,
// activation and down for its rows). With at least two items per thread the threads share out
// whole items, each GEMM inline on its thread (a nested job runs on its caller); with fewer (a
// decode of Mixtral's top-2 on many cores) the items run one after another, each GEMM split
// across the threads by its own panel groups.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "own_kernels.h"
#include "widen.h"
#include "work_sharing.h"

namespace {

using widen::Vec;
constexpr int64_t kPanel = 2 * widen::W;  // gemm.cpp's panel width (linear checks it too)
constexpr int64_t kItemRows = 96;         // rows per item: the GEMM's own row chunk

// The step's pairs grouped by expert: rows [starts[e], starts[e + 1]) are expert e's, in token
// order; pair_of[row] = t * k + s, row_of[t * k + s] = row.
struct Groups {
  std::vector<int64_t> starts, pair_of, row_of;
};

Groups group_by_expert(const int64_t* ids, int64_t num_pairs, int64_t num_experts) {
  Groups g;
  g.starts.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "fused_moe: expert id ", ids[p],
                " out of range for ", num_experts, " experts");
    ++g.starts[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.starts[e + 1] += g.starts[e];
  std::vector<int64_t> fill(g.starts.begin(), g.starts.end() - 1);
  g.pair_of.resize(num_pairs);
  g.row_of.resize(num_pairs);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t row = fill[ids[p]]++;
    g.pair_of[row] = p;
    g.row_of[p] = row;
  }
  return g;
}

inline Vec silu(const Vec& x) {  // as activation.cpp computes it
  const Vec one(1.f);
  return x / (one + x.neg().exp_u20());
}

template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// act[r, :I] = silu(gate) * up from gate_up[r, :2I] (float32 sums), with the model dtype's
// roundings: the products, silu's result, and the product with up.
template <typename T>
void activate(const float* gate_up, float* act, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* a = act + r * inner;
    int64_t i = 0;
    for (; i + widen::W <= inner; i += widen::W) {
      const Vec s = widen::round<T>(silu(widen::round<T>(Vec::loadu(g + i))));
      widen::round<T>(s * widen::round<T>(Vec::loadu(u + i))).store(a + i);
    }
    for (; i < inner; ++i) {
      const float gv = round_to<T>(g[i]);
      const float s = round_to<T>(gv / (1.f + std::exp(-gv)));
      a[i] = round_to<T>(s * round_to<T>(u[i]));
    }
  }
}

struct Item {
  int64_t expert, row0, rows;
};

struct Layer {
  const at::Tensor& hidden;
  const at::Tensor& w13;  // [E, P13, H, NR]
  const at::Tensor& w2;   // [E, P2, I, NR]
  int64_t top_k, hidden_size, inner;
};

at::Tensor floats(float* data, int64_t rows, int64_t cols) {
  return at::from_blob(data, {rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

// One item: its rows of `hidden` gathered into xs (float32), the gate/up product, the
// activation, and the down product written over the same rows of xs.
template <typename T>
void run_item(const Layer& layer, const Item& item, const Groups& groups, float* xs) {
  const int64_t H = layer.hidden_size, I = layer.inner, n = item.rows;
  const T* hidden = layer.hidden.data_ptr<T>();
  const int64_t hidden_stride = layer.hidden.stride(0);
  float* x = xs + item.row0 * H;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t token = groups.pair_of[item.row0 + r] / layer.top_k;
    const T* src = hidden + token * hidden_stride;
    float* dst = x + r * H;
    int64_t h = 0;
    for (; h + widen::W <= H; h += widen::W) widen::load(src + h).store(dst + h);
    for (; h < H; ++h) dst[h] = static_cast<float>(src[h]);
  }
  thread_local std::vector<float> scratch;  // gate_up [n, 2I] then act [n, I], kept per thread
  if (static_cast<int64_t>(scratch.size()) < n * 3 * I) scratch.resize(n * 3 * I);
  float* gate_up = scratch.data();
  float* act = gate_up + n * 2 * I;
  const auto& linear = own_kernels::kernels().linear;
  linear.call(floats(gate_up, n, 2 * I), floats(x, n, H), layer.w13.select(0, item.expert));
  activate<T>(gate_up, act, n, I);
  linear.call(floats(x, n, H), floats(act, n, I), layer.w2.select(0, item.expert));
}

// out[t] = the sum over t's experts in ascending id of round(round(down) * round(weight)),
// each partial sum rounded.
template <typename T>
void combine(at::Tensor& out, const float* down, const float* weights, const int64_t* ids,
             const Groups& groups, int64_t top_k, int64_t H) {
  T* o = out.data_ptr<T>();
  const int64_t tokens = out.size(0);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(top_k);
    std::vector<const float*> rows(top_k);
    std::vector<float> scale(top_k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t s = 0; s < top_k; ++s) order[s] = t * top_k + s;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      for (int64_t j = 0; j < top_k; ++j) {
        rows[j] = down + groups.row_of[order[j]] * H;
        scale[j] = round_to<T>(weights[order[j]]);
      }
      T* dst = o + t * H;
      int64_t h = 0;
      for (; h + widen::W <= H; h += widen::W) {
        Vec acc(0.f);
        for (int64_t j = 0; j < top_k; ++j) {
          const Vec down_h = widen::round<T>(Vec::loadu(rows[j] + h));
          acc = widen::round<T>(acc + widen::round<T>(down_h * Vec(scale[j])));
        }
        widen::store(dst + h, acc);
      }
      for (; h < H; ++h) {
        float acc = 0.f;
        for (int64_t j = 0; j < top_k; ++j) {
          acc = round_to<T>(acc + round_to<T>(round_to<T>(rows[j][h]) * scale[j]));
        }
        dst[h] = static_cast<T>(acc);
      }
    }
  });
}

template <typename T>
void run_layer(at::Tensor& out, const Layer& layer, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids) {
  const int64_t tokens = out.size(0), k = layer.top_k, H = layer.hidden_size;
  const int64_t num_experts = layer.w13.size(0);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const Groups groups = group_by_expert(ids, tokens * k, num_experts);
  std::vector<Item> items;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t r = groups.starts[e]; r < groups.starts[e + 1]; r += kItemRows) {
      items.push_back({e, r, std::min(kItemRows, groups.starts[e + 1] - r)});
    }
  }
  // Every pair's row: its token's hidden state gathered, then its expert's down product (a
  // prefill's are large and not kept: their page faults cost little beside their products).
  const at::Tensor rows = at::empty({tokens * k, H}, at::TensorOptions().dtype(at::kFloat));
  float* xs = rows.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items >= 2 * at::get_num_threads()) {
    std::atomic<int64_t> next{0};
    OCTAVO_CPU_NAMESPACE::parallel_workers(num_items, [&] {
      for (int64_t i = next++; i < num_items; i = next++) run_item<T>(layer, items[i], groups, xs);
    });
  } else {
    for (const Item& item : items) run_item<T>(layer, item, groups, xs);
  }
  combine<T>(out, xs, topk_weights.data_ptr<float>(), ids, groups, k, H);
}

// out[T, H] = the experts' weighted sum for each token of hidden [T, H] (float32 or bfloat16,
// rows may be strided), given its routing: topk_weights [T, k] float32 and topk_ids [T, k]
// int64, and the experts' weights packed (see the top of the file) in the model dtype.
void fused_moe(at::Tensor out, const at::Tensor& hidden, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, const at::Tensor& w13_packed,
               const at::Tensor& w2_packed) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "fused_moe: float32 or bfloat16 hidden states, not ", dtype);
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "fused_moe: hidden must be [T, H] rows");
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.sizes() == hidden.sizes(),
              "fused_moe: out must be contiguous and of hidden's shape and dtype");
  const int64_t tokens = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be contiguous int64 [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat,
              "fused_moe: topk_weights must be contiguous float32 of topk_ids' shape");
  TORCH_CHECK(w13_packed.dim() == 4 && w2_packed.dim() == 4 && w13_packed.is_contiguous() &&
                  w2_packed.is_contiguous() && w13_packed.scalar_type() == dtype &&
                  w2_packed.scalar_type() == dtype,
              "fused_moe: the packed weights must be contiguous [E, P, K, NR] in hidden's dtype");
  const int64_t experts = w13_packed.size(0), inner = w2_packed.size(2);
  TORCH_CHECK(w13_packed.size(3) == kPanel && w2_packed.size(3) == kPanel,
              "fused_moe: the weights were packed by another build (panel width ",
              w13_packed.size(3), ", this one ", kPanel, ")");
  TORCH_CHECK(w2_packed.size(0) == experts && w13_packed.size(2) == H &&
                  w13_packed.size(1) == (2 * inner + kPanel - 1) / kPanel &&
                  w2_packed.size(1) == (H + kPanel - 1) / kPanel,
              "fused_moe: hidden [", tokens, ", ", H, "], w13 packed ", w13_packed.sizes(),
              " and w2 packed ", w2_packed.sizes(), " do not match");
  if (tokens == 0 || H == 0) return;
  const Layer layer{hidden, w13_packed, w2_packed, topk_ids.size(1), H, inner};
  if (dtype == at::kFloat) {
    run_layer<float>(out, layer, topk_weights, topk_ids);
  } else {
    run_layer<at::BFloat16>(out, layer, topk_weights, topk_ids);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "fused_moe(Tensor(a!) out, Tensor hidden, Tensor topk_weights, Tensor topk_ids, "
      "Tensor w13_packed, Tensor w2_packed) -> ()");
  m.impl("fused_moe", c10::DispatchKey::CPU, &fused_moe);
}

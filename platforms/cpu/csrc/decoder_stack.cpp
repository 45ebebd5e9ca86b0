// A Llama-family decoder stack in one call: every layer's norms, projections, rotary
// embedding, KV write and paged attention, and the final norm, by the same compiled kernels the
// model's modules call one by one from Python, in the same order on the same buffers, so the
// hidden states are bit for bit those of the module path. What it removes is the interpreter
// between the ~12 kernels of each layer (module calls, wrappers, views: ~1.5 ms of a 3 ms
// one-token forward of a 4-layer model on a 2 GHz core; ~5 ms of a 30-layer model's).
//
// Each layer hands 10 tensors, in this order: the input norm's weight, the packed qkv weight,
// the qkv bias, the per-head q and k norms' weights (Qwen3), the packed output projection, the
// post-attention norm's weight, the packed gate, up and down projections; the final norm's
// weight comes last. An absent bias or q/k norm is an empty tensor. `linear_types` gives each
// layer's five projections (qkv, o, gate, up, down) their kernel: -1 the float GEMM
// (pack_linear_weight, or pack_linear_weight_bf16 for a bfloat16 model), else the
// quantized_linear type code of a quantized weight's packed rows.
//
// The hidden states are float32 or bfloat16. Both GEMMs take float32 rows, so a bfloat16
// model's projections run as its modules run them: the rows widened to float32, the product and
// the bias in float32, the result rounded to bfloat16.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "own_kernels.h"

namespace {

using own_kernels::Kernels;
using own_kernels::kernels;

constexpr int64_t kTensorsPerLayer = 10;
constexpr int64_t kLinearsPerLayer = 5;
constexpr int64_t kFloatGemm = -1;

// A layer's tensors (see the top of the file) and its projections' kernels.
struct Layer {
  const at::Tensor* w;
  const int64_t* types;  // qkv, o, gate, up, down
  const at::Tensor& input_norm() const { return w[0]; }
  const at::Tensor& qkv() const { return w[1]; }
  const at::Tensor& qkv_bias() const { return w[2]; }
  const at::Tensor& q_norm() const { return w[3]; }
  const at::Tensor& k_norm() const { return w[4]; }
  const at::Tensor& o() const { return w[5]; }
  const at::Tensor& post_norm() const { return w[6]; }
  const at::Tensor& gate() const { return w[7]; }
  const at::Tensor& up() const { return w[8]; }
  const at::Tensor& down() const { return w[9]; }
};

struct Step {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_table;
  const at::Tensor& query_start_loc;
  const at::Tensor& seq_lens;
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size;
  double scale, eps;
  int64_t sliding_window, num_tokens;
};

// x @ W^T (+ bias) in x's dtype, by the kernel `type` names.
at::Tensor project(const Kernels& k, const at::Tensor& x, const at::Tensor& packed, int64_t type,
                   int64_t n, const at::Tensor* bias = nullptr) {
  const bool widen = x.scalar_type() != at::kFloat;
  const at::Tensor rows = widen ? x.to(at::kFloat) : x;
  at::Tensor out = at::empty({x.size(0), n}, rows.options());
  if (type == kFloatGemm) {
    k.linear.call(out, rows, packed);
  } else {
    k.quantized_linear.call(out, rows, packed, type, x.size(1));
  }
  if (bias != nullptr && bias->numel() > 0) out.add_(*bias);
  return widen ? out.to(x.scalar_type()) : out;
}

// RMSNorm over each head_dim-wide piece of `part` (a column range of qkv): a new tensor.
at::Tensor norm_heads(const Kernels& k, const at::Tensor& part, const at::Tensor& weight,
                      int64_t head_dim, double eps) {
  const at::Tensor heads = part.contiguous().view({-1, head_dim});
  at::Tensor out = at::empty_like(heads);
  k.rms_norm.call(out, heads, weight, eps);
  return out.view({part.size(0), part.size(1)});
}

// One layer's attention block: x (normed) -> the output projection's result.
at::Tensor attention_block(const Kernels& k, const at::Tensor& x, const Layer& l,
                           at::Tensor kv_cache, const Step& s) {
  const int64_t T = x.size(0), D = s.head_dim;
  const int64_t q_size = s.num_heads * D, kv_size = s.num_kv_heads * D;
  at::Tensor qkv = project(k, x, l.qkv(), l.types[0], q_size + 2 * kv_size, &l.qkv_bias());
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor key = qkv.narrow(1, q_size, kv_size);
  at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size);
  if (l.q_norm().numel() > 0) {  // Qwen3: each head of q and k normed before the rotation
    q = norm_heads(k, q, l.q_norm(), D, s.eps);
    key = norm_heads(k, key, l.k_norm(), D, s.eps);
  }
  k.rotary.call(q, key, s.cos, s.sin, D);
  at::Tensor q3 = q.view({T, s.num_heads, D});
  at::Tensor out = at::empty_like(q3);
  if (s.num_tokens < T) out.narrow(0, s.num_tokens, T - s.num_tokens).zero_();  // padding rows
  k.paged_attention.call(out, q3, key.view({T, s.num_kv_heads, D}),
                         value.view({T, s.num_kv_heads, D}), kv_cache, s.slot_mapping,
                         s.block_table, s.query_start_loc, s.seq_lens, s.scale, s.sliding_window,
                         s.num_tokens);
  return project(k, out.view({T, q_size}), l.o(), l.types[1], x.size(1));
}

at::Tensor mlp_block(const Kernels& k, const at::Tensor& x, const Layer& l, const Step& s) {
  at::Tensor gate = project(k, x, l.gate(), l.types[2], s.intermediate_size);
  at::Tensor up = project(k, x, l.up(), l.types[3], s.intermediate_size);
  at::Tensor act = at::empty_like(gate);
  k.silu_and_mul.call(act, gate, up);
  return project(k, act, l.down(), l.types[4], x.size(1));
}

at::Tensor decoder_stack(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         at::IntArrayRef linear_types, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t intermediate_size, double scale, int64_t sliding_window,
                         double eps, int64_t num_tokens) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kTensorsPerLayer + 1,
              "decoder_stack: ", kTensorsPerLayer, " tensors per layer and the final norm's "
              "weight, got ", weights.size(), " for ", num_layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(linear_types.size()) == num_layers * kLinearsPerLayer,
              "decoder_stack: ", kLinearsPerLayer, " linear types per layer, got ",
              linear_types.size(), " for ", num_layers, " layers");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous() &&
                  (hidden_in.scalar_type() == at::kFloat ||
                   hidden_in.scalar_type() == at::kBFloat16),
              "decoder_stack: hidden states must be contiguous float32 or bfloat16 [T, hidden]");
  const Kernels& k = kernels();
  const Step s{cos, sin, slot_mapping, block_table, query_start_loc, seq_lens,
               num_heads, num_kv_heads, head_dim, intermediate_size, scale, eps,
               sliding_window, num_tokens};
  at::Tensor hidden = hidden_in, residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const Layer l{weights.data() + layer * kTensorsPerLayer,
                  linear_types.data() + layer * kLinearsPerLayer};
    at::Tensor x = at::empty_like(hidden);
    if (layer == 0) {
      k.rms_norm.call(x, hidden, l.input_norm(), eps);
      residual = hidden;
    } else {
      at::Tensor summed = at::empty_like(hidden);
      k.fused_add_rms_norm.call(x, summed, hidden, residual, l.input_norm(), eps);
      residual = summed;
    }
    at::Tensor attended = attention_block(k, x, l, kv_caches[layer], s);
    at::Tensor normed = at::empty_like(attended), summed = at::empty_like(attended);
    k.fused_add_rms_norm.call(normed, summed, attended, residual, l.post_norm(), eps);
    residual = summed;
    hidden = mlp_block(k, normed, l, s);
  }
  at::Tensor out = at::empty_like(hidden);
  if (num_layers == 0) {
    k.rms_norm.call(out, hidden, weights.back(), eps);
  } else {
    at::Tensor summed = at::empty_like(hidden);
    k.fused_add_rms_norm.call(out, summed, hidden, residual, weights.back(), eps);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "decoder_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!)[] "
      "kv_caches, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
      "Tensor seq_lens, int[] linear_types, int num_heads, int num_kv_heads, int head_dim, int intermediate_size, "
      "float scale, int sliding_window, float eps, int num_tokens) -> Tensor");
  m.impl("decoder_stack", c10::DispatchKey::CPU, &decoder_stack);
}

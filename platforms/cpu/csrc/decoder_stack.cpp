// A Llama decoder stack in one call: every layer's norms, projections, rotary embedding, KV
// write and paged attention, and the final norm, by the same compiled kernels the model's
// modules call one by one from Python, in the same order on the same buffers, so the hidden
// states are bit for bit those of the module path. What it removes is the interpreter between
// the ~12 kernels of each layer (module calls, wrappers, views: ~1.5 ms of a 3 ms one-token
// forward of a 4-layer model on a 2 GHz core).
//
// Each layer hands 7 tensors, in this order: the input norm's weight, the packed qkv weight,
// the packed output projection, the post-attention norm's weight, the packed gate, up and down
// projections (pack_linear_weight); the final norm's weight comes last.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "own_kernels.h"

namespace {

using own_kernels::Kernels;
using own_kernels::kernels;

constexpr int64_t kTensorsPerLayer = 7;

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

at::Tensor project(const Kernels& k, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  k.linear.call(out, x, packed);
  return out;
}

// One layer's attention block: x (normed) -> the output projection's result.
at::Tensor attention_block(const Kernels& k, const at::Tensor& x, const at::Tensor* w,
                           at::Tensor kv_cache, const Step& s) {
  const int64_t T = x.size(0), D = s.head_dim;
  const int64_t q_size = s.num_heads * D, kv_size = s.num_kv_heads * D;
  at::Tensor qkv = project(k, x, w[1], q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor key = qkv.narrow(1, q_size, kv_size);
  at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size);
  k.rotary.call(q, key, s.cos, s.sin, D);
  at::Tensor q3 = q.view({T, s.num_heads, D});
  at::Tensor out = at::empty_like(q3);
  if (s.num_tokens < T) out.narrow(0, s.num_tokens, T - s.num_tokens).zero_();  // padding rows
  k.paged_attention.call(out, q3, key.view({T, s.num_kv_heads, D}),
                         value.view({T, s.num_kv_heads, D}), kv_cache, s.slot_mapping,
                         s.block_table, s.query_start_loc, s.seq_lens, s.scale, s.sliding_window,
                         s.num_tokens);
  return project(k, out.view({T, q_size}), w[2], x.size(1));
}

at::Tensor mlp_block(const Kernels& k, const at::Tensor& x, const at::Tensor* w, const Step& s) {
  at::Tensor gate = project(k, x, w[4], s.intermediate_size);
  at::Tensor up = project(k, x, w[5], s.intermediate_size);
  at::Tensor act = at::empty_like(gate);
  k.silu_and_mul.call(act, gate, up);
  return project(k, act, w[6], x.size(1));
}

at::Tensor decoder_stack(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t intermediate_size, double scale, int64_t sliding_window,
                         double eps, int64_t num_tokens) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kTensorsPerLayer + 1,
              "decoder_stack: ", kTensorsPerLayer, " tensors per layer and the final norm's "
              "weight, got ", weights.size(), " for ", num_layers, " layers");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous() &&
                  hidden_in.scalar_type() == at::kFloat,
              "decoder_stack: hidden states must be contiguous float32 [T, hidden]");
  const Kernels& k = kernels();
  const Step s{cos, sin, slot_mapping, block_table, query_start_loc, seq_lens,
               num_heads, num_kv_heads, head_dim, intermediate_size, scale, eps,
               sliding_window, num_tokens};
  at::Tensor hidden = hidden_in, residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kTensorsPerLayer;
    at::Tensor x = at::empty_like(hidden);
    if (layer == 0) {
      k.rms_norm.call(x, hidden, w[0], eps);
      residual = hidden;
    } else {
      at::Tensor summed = at::empty_like(hidden);
      k.fused_add_rms_norm.call(x, summed, hidden, residual, w[0], eps);
      residual = summed;
    }
    at::Tensor attended = attention_block(k, x, w, kv_caches[layer], s);
    at::Tensor normed = at::empty_like(attended), summed = at::empty_like(attended);
    k.fused_add_rms_norm.call(normed, summed, attended, residual, w[3], eps);
    residual = summed;
    hidden = mlp_block(k, normed, w, s);
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
      "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, int intermediate_size, "
      "float scale, int sliding_window, float eps, int num_tokens) -> Tensor");
  m.impl("decoder_stack", c10::DispatchKey::CPU, &decoder_stack);
}

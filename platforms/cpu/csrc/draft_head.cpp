// An EAGLE-family draft head's inputs in one call: each token's pair [embedding of its token,
// hidden state] (or, at a P-EAGLE masked slot, the head's learned mask embedding and mask
// hidden state), the head's `fc` over the pairs, and the rotary tables at the tokens'
// positions; and a Gumiho head's parallel MLP heads in another. The modules make the same
// numbers with a dozen torch calls from Python each (an embedding lookup, two `where`s, a
// concatenation, the packed `fc`, two table lookups; six module calls per MLP head), each
// costing more than its arithmetic on a batch-1 step's few rows; the pairs are copies and the
// kernels are the modules' own, in their order, so the results are bit for bit the modules'.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "own_kernels.h"

namespace {

using own_kernels::Kernels;
using own_kernels::kernels;

void check_float_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(-1) == width,
              "draft head: ", what, " must be contiguous float32 with rows of ", width);
}

// [T, 2 * hidden]: each token's [embedding of its token, hidden state]. Without `masked`,
// token t reads hidden row t; with it (bool [T]), the masked tokens read the mask tensors
// instead and the others the rows of `hidden` in order (one row per unmasked token).
at::Tensor pairs_of(const at::Tensor& input_ids, const at::Tensor& hidden,
                    const c10::optional<at::Tensor>& masked, const at::Tensor& embedding,
                    const c10::optional<at::Tensor>& mask_embedding,
                    const c10::optional<at::Tensor>& mask_hidden) {
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong &&
                  input_ids.is_contiguous(),
              "draft head: input_ids must be contiguous int64 [T]");
  TORCH_CHECK(embedding.dim() == 2, "draft head: embedding must be [vocab, hidden]");
  const int64_t T = input_ids.size(0), H = embedding.size(1);
  check_float_rows(embedding, H, "the embedding");
  check_float_rows(hidden, H, "the hidden states");
  const bool has_mask = masked.has_value();
  if (has_mask) {
    TORCH_CHECK(masked->scalar_type() == at::kBool && masked->dim() == 1 &&
                    masked->size(0) == T && masked->is_contiguous(),
                "draft head: masked must be contiguous bool [T]");
    TORCH_CHECK(mask_embedding.has_value() && mask_hidden.has_value(),
                "draft head: masked tokens need the mask embedding and hidden state");
    check_float_rows(*mask_embedding, H, "the mask embedding");
    check_float_rows(*mask_hidden, H, "the mask hidden state");
  }
  const int64_t vocab = embedding.size(0);
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const bool* is_masked = has_mask ? masked->data_ptr<bool>() : nullptr;
  int64_t unmasked = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (is_masked != nullptr && is_masked[t]) continue;
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "draft head: token id ", ids[t],
                " outside the vocabulary of ", vocab);
    ++unmasked;
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == unmasked, "draft head: ", unmasked,
              " unmasked tokens but ", hidden.size(0), " hidden state rows");

  at::Tensor pairs = at::empty({T, 2 * H}, embedding.options());
  const float* emb = embedding.data_ptr<float>();
  const float* hid = hidden.data_ptr<float>();
  const float* mask_emb = has_mask ? mask_embedding->data_ptr<float>() : nullptr;
  const float* mask_hid = has_mask ? mask_hidden->data_ptr<float>() : nullptr;
  float* out = pairs.data_ptr<float>();
  for (int64_t t = 0, row = 0; t < T; ++t) {
    const bool m = is_masked != nullptr && is_masked[t];
    const float* e = m ? mask_emb : emb + ids[t] * H;
    const float* h = m ? mask_hid : hid + (row++) * H;
    std::copy(e, e + H, out + t * 2 * H);
    std::copy(h, h + H, out + t * 2 * H + H);
  }
  return pairs;
}

// (fc(pairs_of(...)) [T, fc_out], cos [T, 1, D], sin [T, 1, D]): an EAGLE head's layer input
// and rotary tables.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_head_inputs(
    const at::Tensor& input_ids, const at::Tensor& hidden, const c10::optional<at::Tensor>& masked,
    const at::Tensor& embedding, const c10::optional<at::Tensor>& mask_embedding,
    const c10::optional<at::Tensor>& mask_hidden, const at::Tensor& fc_packed, int64_t fc_out,
    const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  at::Tensor pairs = pairs_of(input_ids, hidden, masked, embedding, mask_embedding, mask_hidden);
  at::Tensor x = at::empty({input_ids.size(0), fc_out}, embedding.options());
  kernels().linear.call(x, pairs, fc_packed);
  at::Tensor cos = at::index_select(cos_cache, 0, positions).unsqueeze(1);
  at::Tensor sin = at::index_select(sin_cache, 0, positions).unsqueeze(1);
  return {x, cos, sin};
}

// A Gumiho head's parallel MLP heads, the first `count` of them, each from the same pairs
// [embedding of the last serial draft, the serial head's hidden state]: x = fc(pair), then
// norm(x + down(silu(gate(n)) * up(n))) with n = mlp_norm(x), by the kernels (and in the order)
// of the heads' modules. Each head hands 6 tensors: fc, gate, up and down packed
// (pack_linear_weight) and the two norms' weights, as fc, mlp_norm, gate, up, down, norm.
// Returns [count, R, hidden].
at::Tensor draft_mlp_heads(const at::Tensor& input_ids, const at::Tensor& hidden,
                           const at::Tensor& embedding, at::TensorList weights,
                           int64_t intermediate_size, double eps, int64_t count) {
  constexpr int64_t kTensorsPerHead = 6;
  TORCH_CHECK(count >= 0 && static_cast<int64_t>(weights.size()) >= count * kTensorsPerHead,
              "draft_mlp_heads: ", kTensorsPerHead, " tensors per head, got ", weights.size(),
              " for ", count, " heads");
  const int64_t R = input_ids.size(0), H = embedding.size(1);
  const at::Tensor pairs =
      pairs_of(input_ids, hidden, c10::nullopt, embedding, c10::nullopt, c10::nullopt);
  const Kernels& k = kernels();
  at::Tensor out = at::empty({count, R, H}, embedding.options());
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerHead;
    at::Tensor x = at::empty({R, H}, embedding.options());
    k.linear.call(x, pairs, w[0]);
    at::Tensor normed = at::empty_like(x);
    k.rms_norm.call(normed, x, w[1], eps);
    at::Tensor gate = at::empty({R, intermediate_size}, x.options());
    at::Tensor up = at::empty_like(gate), act = at::empty_like(gate);
    k.linear.call(gate, normed, w[2]);
    k.linear.call(up, normed, w[3]);
    k.silu_and_mul.call(act, gate, up);
    at::Tensor mlp = at::empty_like(x), summed = at::empty_like(x);
    k.linear.call(mlp, act, w[4]);
    k.fused_add_rms_norm.call(out.select(0, i), summed, mlp, x, w[5], eps);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "draft_mlp_heads(Tensor input_ids, Tensor hidden, Tensor embedding, Tensor[] weights, "
      "int intermediate_size, float eps, int count) -> Tensor");
  m.impl("draft_mlp_heads", c10::DispatchKey::CPU, &draft_mlp_heads);
  m.def(
      "draft_head_inputs(Tensor input_ids, Tensor hidden, Tensor? masked, Tensor embedding, "
      "Tensor? mask_embedding, Tensor? mask_hidden, Tensor fc_packed, int fc_out, "
      "Tensor positions, Tensor cos_cache, Tensor sin_cache) -> (Tensor, Tensor, Tensor)");
  m.impl("draft_head_inputs", c10::DispatchKey::CPU, &draft_head_inputs);
}

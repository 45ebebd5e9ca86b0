// An EAGLE-family draft head's inputs in one call: each token's pair [embedding of its token,
// hidden state] (or, at a P-EAGLE masked slot, the head's learned mask embedding and mask
// hidden state), the head's `fc` over the pairs, and the rotary tables at the tokens'
// positions. The module path makes the same numbers with a dozen torch calls from Python (an
// embedding lookup, two `where`s, a concatenation, the packed `fc`, two table lookups), each of
// which costs more than its arithmetic on a batch-1 head pass of a few tokens; the pairs are
// copies and `fc` is the same compiled GEMM, so the results are bit for bit the modules'.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#define OCTAVO_CPU_STR2(x) #x
#define OCTAVO_CPU_STR(x) OCTAVO_CPU_STR2(x)

namespace {

using LinearFn = void(at::Tensor, const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<LinearFn>& linear_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(OCTAVO_CPU_STR(OCTAVO_CPU_NAMESPACE) "::linear", "")
          .typed<LinearFn>();
  return op;
}

void check_float_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(-1) == width,
              "draft_head_inputs: ", what, " must be contiguous float32 with rows of ", width);
}

// (fc([embedding or mask_embedding, hidden or mask_hidden]) [T, fc_out], cos [T, 1, D],
// sin [T, 1, D]). Without `masked`, token t reads hidden row t; with it (bool [T]), the masked
// tokens read the mask tensors and the others the rows of `hidden` in order (hidden has one row
// per unmasked token).
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_head_inputs(
    const at::Tensor& input_ids, const at::Tensor& hidden, const c10::optional<at::Tensor>& masked,
    const at::Tensor& embedding, const c10::optional<at::Tensor>& mask_embedding,
    const c10::optional<at::Tensor>& mask_hidden, const at::Tensor& fc_packed, int64_t fc_out,
    const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  const int64_t T = input_ids.size(0), H = embedding.size(1);
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong &&
                  input_ids.is_contiguous(),
              "draft_head_inputs: input_ids must be contiguous int64 [T]");
  TORCH_CHECK(embedding.dim() == 2, "draft_head_inputs: embedding must be [vocab, hidden]");
  check_float_rows(embedding, H, "the embedding");
  check_float_rows(hidden, H, "the hidden states");
  const bool has_mask = masked.has_value();
  if (has_mask) {
    TORCH_CHECK(masked->scalar_type() == at::kBool && masked->dim() == 1 &&
                    masked->size(0) == T && masked->is_contiguous(),
                "draft_head_inputs: masked must be contiguous bool [T]");
    TORCH_CHECK(mask_embedding.has_value() && mask_hidden.has_value(),
                "draft_head_inputs: masked tokens need the mask embedding and hidden state");
    check_float_rows(*mask_embedding, H, "the mask embedding");
    check_float_rows(*mask_hidden, H, "the mask hidden state");
  }
  const int64_t vocab = embedding.size(0);
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const bool* is_masked = has_mask ? masked->data_ptr<bool>() : nullptr;
  int64_t unmasked = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (is_masked != nullptr && is_masked[t]) continue;
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "draft_head_inputs: token id ", ids[t],
                " outside the vocabulary of ", vocab);
    ++unmasked;
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == unmasked, "draft_head_inputs: ", unmasked,
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
  at::Tensor x = at::empty({T, fc_out}, embedding.options());
  linear_op().call(x, pairs, fc_packed);
  at::Tensor cos = at::index_select(cos_cache, 0, positions).unsqueeze(1);
  at::Tensor sin = at::index_select(sin_cache, 0, positions).unsqueeze(1);
  return {x, cos, sin};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "draft_head_inputs(Tensor input_ids, Tensor hidden, Tensor? masked, Tensor embedding, "
      "Tensor? mask_embedding, Tensor? mask_hidden, Tensor fc_packed, int fc_out, "
      "Tensor positions, Tensor cos_cache, Tensor sin_cache) -> (Tensor, Tensor, Tensor)");
  m.impl("draft_head_inputs", c10::DispatchKey::CPU, &draft_head_inputs);
}

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

// A draft head's tensors and its decoder stack's shape, as greedy_head_drafts takes them.
struct HeadTensors {
  const at::Tensor& embedding;
  const c10::optional<at::Tensor>& mask_embedding;
  const c10::optional<at::Tensor>& mask_hidden;
  const at::Tensor& fc_packed;
  int64_t fc_out;
  const at::Tensor& cos_cache;
  const at::Tensor& sin_cache;
  at::TensorList stack_weights;
  at::TensorList kv_caches;
  at::IntArrayRef stack;
  double scale, eps;
};

// The head's forward over tokens `ids` at `positions` (with `masked` slots), its KV written to
// `slots`: draft_head_inputs, then the decoder stack.
at::Tensor head_forward(const HeadTensors& h, const at::Tensor& ids, const at::Tensor& hidden,
                        const c10::optional<at::Tensor>& masked, const at::Tensor& positions,
                        const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  auto [x, cos, sin] = draft_head_inputs(ids, hidden, masked, h.embedding, h.mask_embedding,
                                         h.mask_hidden, h.fc_packed, h.fc_out, positions,
                                         h.cos_cache, h.sin_cache);
  // h.stack: the stack's five shape arguments, then its linear types (shape_arguments()).
  return kernels().decoder_stack.call(x, cos, sin, h.stack_weights, h.kv_caches, slots,
                                      block_table, query_start_loc, seq_lens, h.stack.slice(5),
                                      h.stack[0],
                                      h.stack[1], h.stack[2], h.stack[3], h.scale, h.stack[4],
                                      h.eps, ids.size(0));
}

// The KV slot of `position` in a row's blocks (`row_table`).
inline int64_t slot_of(const int32_t* row_table, int64_t position, int64_t block_size) {
  return static_cast<int64_t>(row_table[position / block_size]) * block_size +
         position % block_size;
}

// A greedy step's drafts in one call: the head's pass over each row's verified positions of the
// step and `steps` greedy drafts per row, as the Python proposers make them a kernel at a time
// (the same kernels on the same inputs, so the same drafts and head KV; what goes is the
// interpreter between the kernels and the attention metadata built in numpy):
//
// - the pass: row r (batch row rows[r]) runs positions first[r] .. first[r] + num_verified[r]
//   - 1, each with the token after it (token_ids[rows[r], position + 1]) and its hidden state
//   (`hidden`, [sum(num_verified), H], flat in row order), its KV written to the position's
//   slot in the row's blocks (block_table[rows[r]]); with `parallel` (P-EAGLE) each row runs
//   steps - 1 masked slots after them (the head's mask embedding and hidden state);
// - `parallel`: draft d of a row is the greedy draft (the LM head's argmax, greedy_tokens) of
//   the pass's output at its last verified position + d, all in one LM-head product;
// - serial (EAGLE, Gumiho's first drafts): draft 0 from the output at the last verified
//   position p, then for j = 1 .. steps - 1 a head step at position p + j reads draft j - 1
//   (the token after p + j) and the prediction it was scored from, writes its KV there and
//   scores draft j;
// - then, for a Gumiho head (`mlp_drafts` > 0, after serial drafts), drafts steps .. steps +
//   mlp_drafts - 1 from its first mlp_drafts MLP heads (draft_mlp_heads over `mlp_weights`)
//   reading the last serial draft and its prediction, scored in one LM-head product.
//
// Returns (drafts [R, steps + mlp_drafts] int64, the predictions the last serial drafts, or
// P-EAGLE's last drafts, were scored from [R, H]).
// `stack` holds the decoder stack's shape as its op takes it: num_heads, num_kv_heads,
// head_dim, intermediate_size, sliding_window.
std::tuple<at::Tensor, at::Tensor> greedy_head_drafts(
    const at::Tensor& hidden, const at::Tensor& rows, const at::Tensor& first,
    const at::Tensor& num_verified, int64_t steps, bool parallel, const at::Tensor& token_ids,
    const at::Tensor& block_table, int64_t block_size, const at::Tensor& lm_head_packed,
    int64_t vocab, const at::Tensor& embedding, const c10::optional<at::Tensor>& mask_embedding,
    const c10::optional<at::Tensor>& mask_hidden, const at::Tensor& fc_packed, int64_t fc_out,
    const at::Tensor& cos_cache, const at::Tensor& sin_cache, at::TensorList stack_weights,
    at::TensorList kv_caches, at::IntArrayRef stack, double scale, double eps,
    int64_t mlp_drafts, at::TensorList mlp_weights, int64_t mlp_intermediate_size,
    double mlp_eps) {
  const int64_t R = rows.size(0);
  for (const at::Tensor* t : {&rows, &first, &num_verified}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == R &&
                    t->is_contiguous(),
                "greedy_head_drafts: rows, first and num_verified must be contiguous int64 [R]");
  }
  TORCH_CHECK(token_ids.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt &&
                  token_ids.dim() == 2 && block_table.dim() == 2 && token_ids.is_contiguous() &&
                  block_table.is_contiguous(),
              "greedy_head_drafts: token_ids and block_table must be contiguous int32 tables");
  TORCH_CHECK(steps >= 1 && block_size > 0 && stack.size() >= 5,
              "greedy_head_drafts: at least one draft, a positive block size and the stack's "
              "shape in 5 numbers, then its linear types");
  TORCH_CHECK(mlp_drafts == 0 || !parallel,
              "greedy_head_drafts: MLP heads' drafts follow serial drafts only");
  const int64_t masked_slots = parallel ? steps - 1 : 0;
  const int64_t scored_per_row = parallel ? steps : 1;  // the pass's outputs drafts come from
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* from = first.data_ptr<int64_t>();
  const int64_t* verified = num_verified.data_ptr<int64_t>();
  const int64_t num_rows = token_ids.size(0), row_len = token_ids.size(1);
  const int64_t table_cols = block_table.size(1);
  int64_t num_tokens = 0, num_cols = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t last_position = from[r] + verified[r] - 1 + steps - 1;  // its KV written
    TORCH_CHECK(row_of[r] >= 0 && row_of[r] < num_rows && from[r] >= 0 && verified[r] >= 1 &&
                    from[r] + verified[r] < row_len,
                "greedy_head_drafts: row ", r, " (batch row ", row_of[r], ", ", verified[r],
                " verified positions from ", from[r], ") is outside the token table");
    TORCH_CHECK(last_position / block_size < table_cols, "greedy_head_drafts: row ", r,
                "'s positions up to ", last_position, " need more than the ", table_cols,
                " blocks of its block table");
    num_tokens += verified[r] + masked_slots;
    num_cols = std::max(num_cols, last_position / block_size + 1);
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == num_tokens - R * masked_slots,
              "greedy_head_drafts: ", num_tokens - R * masked_slots,
              " verified positions but ", hidden.size(0), " hidden state rows");
  const at::TensorOptions longs = rows.options(), ints = block_table.options();
  const int32_t* tokens = token_ids.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  // The rows' block tables (num_cols blocks each) and the pass's metadata.
  at::Tensor row_tables = at::empty({R, num_cols}, ints);
  at::Tensor ids = at::empty({num_tokens}, longs), positions = at::empty({num_tokens}, longs);
  at::Tensor slots = at::empty({num_tokens}, longs);
  at::Tensor masked = at::empty({num_tokens}, longs.dtype(at::kBool));
  at::Tensor query_start_loc = at::empty({R + 1}, ints), seq_lens = at::empty({R}, ints);
  at::Tensor last = at::empty({R * scored_per_row}, longs);
  int32_t* bt = row_tables.data_ptr<int32_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  bool* is_masked = masked.data_ptr<bool>();
  int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t* scored = last.data_ptr<int64_t>();
  qsl[0] = 0;
  for (int64_t r = 0, t = 0; r < R; ++r) {
    const int32_t* row_table = table + row_of[r] * table_cols;
    std::copy(row_table, row_table + num_cols, bt + r * num_cols);
    const int64_t count = verified[r] + masked_slots;
    for (int64_t i = 0; i < count; ++i, ++t) {
      pos[t] = from[r] + i;
      is_masked[t] = i >= verified[r];
      id[t] = is_masked[t] ? 0 : tokens[row_of[r] * row_len + pos[t] + 1];
      slot[t] = slot_of(row_table, pos[t], block_size);
    }
    qsl[r + 1] = static_cast<int32_t>(t);
    lens[r] = static_cast<int32_t>(from[r] + count);
    for (int64_t d = 0; d < scored_per_row; ++d) {
      scored[r * scored_per_row + d] = t - count + verified[r] - 1 + d;
    }
  }
  const HeadTensors h{embedding, mask_embedding, mask_hidden, fc_packed, fc_out, cos_cache,
                      sin_cache, stack_weights, kv_caches, stack, scale, eps};
  const c10::optional<at::Tensor> pass_masked =
      masked_slots > 0 ? c10::optional<at::Tensor>(masked) : c10::nullopt;
  const at::Tensor predicted = head_forward(h, ids, hidden.contiguous(), pass_masked, positions,
                                            slots, row_tables, query_start_loc, seq_lens);
  const Kernels& k = kernels();
  if (parallel) {
    const at::Tensor outputs = at::index_select(predicted, 0, last);  // [R * steps, H]
    at::Tensor drafts = at::empty({R * steps}, longs);
    k.greedy_tokens.call(drafts, outputs, lm_head_packed, vocab);
    return {drafts.view({R, steps}),
            outputs.view({R, steps, -1}).select(1, steps - 1).contiguous()};
  }
  at::Tensor drafts = at::empty({steps, R}, longs);
  at::Tensor step_positions = at::empty({R}, longs), step_slots = at::empty({R}, longs);
  at::Tensor step_start_loc = at::arange(R + 1, ints);
  at::Tensor prediction = at::index_select(predicted, 0, last);
  for (int64_t j = 0; j < steps; ++j) {
    k.greedy_tokens.call(drafts.select(0, j), prediction, lm_head_packed, vocab);
    if (j + 1 == steps) break;
    int64_t* step_pos = step_positions.data_ptr<int64_t>();
    int64_t* step_slot = step_slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      step_pos[r] = from[r] + verified[r] + j;  // p + j + 1, its token draft j
      step_slot[r] = slot_of(bt + r * num_cols, step_pos[r], block_size);
      lens[r] = static_cast<int32_t>(step_pos[r] + 1);
    }
    prediction = head_forward(h, drafts.select(0, j), prediction, c10::nullopt, step_positions,
                              step_slots, row_tables, step_start_loc, seq_lens);
  }
  if (mlp_drafts == 0) return {drafts.t().contiguous(), prediction};
  // A Gumiho head's MLP heads: drafts steps .. steps + mlp_drafts - 1 from the last serial
  // draft and its prediction, in one LM-head product.
  const at::Tensor predicted_after = draft_mlp_heads(drafts.select(0, steps - 1), prediction,
                                                     embedding, mlp_weights, mlp_intermediate_size,
                                                     mlp_eps, mlp_drafts);  // [mlp_drafts, R, H]
  at::Tensor later = at::empty({mlp_drafts, R}, longs);
  k.greedy_tokens.call(later.view({-1}), predicted_after.view({mlp_drafts * R, -1}),
                       lm_head_packed, vocab);
  return {at::cat({drafts, later}).t().contiguous(), prediction};
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
  m.def(
      "greedy_head_drafts(Tensor hidden, Tensor rows, Tensor first, Tensor num_verified, "
      "int steps, bool parallel, Tensor token_ids, Tensor block_table, int block_size, "
      "Tensor lm_head_packed, int vocab, Tensor embedding, Tensor? mask_embedding, "
      "Tensor? mask_hidden, Tensor fc_packed, int fc_out, Tensor cos_cache, Tensor sin_cache, "
      "Tensor[] stack_weights, Tensor(a!)[] kv_caches, int[] stack, float scale, float eps, "
      "int mlp_drafts, Tensor[] mlp_weights, int mlp_intermediate_size, float mlp_eps) -> "
      "(Tensor, Tensor)");
  m.impl("greedy_head_drafts", c10::DispatchKey::CPU, &greedy_head_drafts);
}

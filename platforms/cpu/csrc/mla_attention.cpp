// Multi-head latent attention (DeepSeek-V2/V3's MLA) for the cpu platform: one call writes the
// step's cache rows and attends every request of the mixed batch (prefill chunks and decodes)
// where the rows lie, through the block table.
//
// Cache layout (the contract of octavo.platform.types.MLAAttentionBackend): [num_blocks,
// block_size, W], one row per token, W = kv_lora_rank (L, the latent) + qk_rope_head_dim (the
// rotary key), shared by every head. A query row [W] scores a cached row by a dot product over
// W; the value of a cached token is its row's first L elements.
//
// Work is split into items (request, a tile of its query tokens, a group of heads). An item's
// query rows (its heads at its tokens) are attended together a group of kGroupTokens context
// tokens at a time: each cached row is loaded once for all of them (the scores are a small
// register-blocked GEMM: kMaxRows query rows against two cached rows per pass over W; the
// weighted sum is one over L, kMaxRows rows at once). Softmax is online, in float32, one
// rescaling per group. A bfloat16 cache is widened in registers, or once into the scratch when
// more rows than one pass read it (a prefill tile).
//
// Batch invariance: a query row's result is the same chain of operations whatever rows share its
// item: its scores are its own accumulators reduced in a fixed order, its groups start every
// kGroupTokens tokens of its request's context, and the tokens its item attends beyond the row's
// own causal range add probabilities that are exactly 0. So a request's output does not depend
// on the other requests of the step, nor on how heads are grouped into items.

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#include "widen.h"
#include "work_sharing.h"

namespace {

using widen::Vec;
constexpr int64_t kW = widen::W;
constexpr int64_t kQueryTile = 16;    // query tokens of one request per work item
constexpr int64_t kMaxItemRows = 128;  // query rows (heads x tokens) per work item at most
constexpr int64_t kGroupTokens = 64;  // context tokens per online-softmax step
// Query rows scored or accumulated at once: with two cached-row vectors (or two latent vectors)
// beside them, 16 accumulators fit AVX-512's 32 registers, 8 AVX2's 16.
constexpr int kMaxRows = kW >= 16 ? 8 : 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t heads, latent, width, block_size, max_blocks;
  float scale;
  int64_t q_token_stride, q_head_stride, row_stride;  // elements between query tokens/heads,
                                                      // and between the new rows
};

struct Item {
  int64_t request, head, heads;  // heads [head, head + heads)
  int64_t q_begin, q_end;        // query tokens, relative to the request's first
};

// Per-thread scratch of one item: query rows (pre-scaled, float32), their accumulators and
// running max and sum, one group's scores, each row's visible range of the group, and a group
// of cached rows widened to float32.
struct Scratch {
  std::vector<float> q, acc, m, l, s, rows;
  std::vector<int64_t> lo, hi;
  void reserve(int64_t n, const Shape& sh) {
    q.resize(n * sh.width);
    acc.assign(n * sh.latent, 0.f);
    m.assign(n, kNegInf);
    l.assign(n, 0.f);
    s.resize(n * kGroupTokens);
    rows.resize(kGroupTokens * sh.width);
    lo.resize(n);
    hi.resize(n);
  }
};

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

// s[g * kGroupTokens + c] = q[g] . rows[c] for R query rows and C cached rows, over the width W:
// whole vectors with one accumulator per (row, cached row), reduced in a fixed order, then the
// last W % kW elements one at a time.
template <int R, int C, typename T>
inline void score_tile(const float* q, int64_t W, const T* const* rows, float* s) {
  Vec sum[R][C];
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < C; ++c) sum[g][c] = Vec(0.f);
  }
  int64_t d = 0;
  for (; d + kW <= W; d += kW) {
    Vec kv[C];
    for (int c = 0; c < C; ++c) kv[c] = widen::load(rows[c] + d);
    for (int g = 0; g < R; ++g) {
      const Vec qd = Vec::loadu(q + g * W + d);
      for (int c = 0; c < C; ++c) sum[g][c] = at::vec::fmadd(qd, kv[c], sum[g][c]);
    }
  }
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < C; ++c) {
      float score = at::vec::vec_reduce_all<float>(
          [](Vec& x, Vec& y) { return x + y; }, sum[g][c]);
      for (int64_t e = d; e < W; ++e) score = std::fma(q[g * W + e], as_float(rows[c][e]), score);
      s[g * kGroupTokens + c] = score;
    }
  }
}

// Columns [d0, d0 + P * kW) of R accumulator rows: acc = acc * correction + p . latent over the
// group's tokens [lo, hi).
template <int R, int P, typename T>
inline void accumulate_tile(const float* s, const T* const* rows, int64_t lo, int64_t hi,
                            int64_t d0, int64_t L, const float* correction, float* acc) {
  Vec sum[R][P];
  for (int g = 0; g < R; ++g) {
    const Vec scale(correction[g]);
    for (int c = 0; c < P; ++c) sum[g][c] = Vec::loadu(acc + g * L + d0 + c * kW) * scale;
  }
  for (int64_t t = lo; t < hi; ++t) {
    Vec v[P];
    for (int c = 0; c < P; ++c) v[c] = widen::load(rows[t] + d0 + c * kW);
    for (int g = 0; g < R; ++g) {
      const Vec pg(s[g * kGroupTokens + t]);
      for (int c = 0; c < P; ++c) sum[g][c] = at::vec::fmadd(pg, v[c], sum[g][c]);
    }
  }
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < P; ++c) sum[g][c].store(acc + g * L + d0 + c * kW);
  }
}

// The last L % kW columns of R rows, element by element (the same operations as a vector lane).
template <int R, typename T>
inline void accumulate_tail(const float* s, const T* const* rows, int64_t lo, int64_t hi,
                            int64_t d0, int64_t L, const float* correction, float* acc) {
  for (int g = 0; g < R; ++g) {
    for (int64_t d = d0; d < L; ++d) {
      float sum = acc[g * L + d] * correction[g];
      for (int64_t t = lo; t < hi; ++t) {
        sum = std::fma(s[g * kGroupTokens + t], as_float(rows[t][d]), sum);
      }
      acc[g * L + d] = sum;
    }
  }
}

// fn(std::integral_constant<int, count>()) for 1 <= count <= kMaxRows: the kernels' row count
// as a compile-time constant.
template <int R = kMaxRows, typename Fn>
inline void with_rows(int64_t count, const Fn& fn) {
  if constexpr (R > 1) {
    if (count < R) {
      with_rows<R - 1>(count, fn);
      return;
    }
  }
  fn(std::integral_constant<int, R>());
}

// One online-softmax step of each row: its scores s[g] of the group's n tokens, of which it sees
// [lo[g], hi[g]), become probabilities; m, l are updated and correction[g] is the factor its
// accumulator is rescaled by. A row that sees none of the group is left as it was.
inline void softmax_step(int64_t count, int64_t n, const int64_t* lo, const int64_t* hi, float* s,
                         float* m, float* l, float* correction) {
  const int64_t padded = (n + kW - 1) / kW * kW;
  for (int64_t g = 0; g < count; ++g) {
    float* sg = s + g * kGroupTokens;
    if (lo[g] >= hi[g]) {
      std::fill(sg, sg + padded, 0.f);
      correction[g] = 1.f;
      continue;
    }
    for (int64_t t = 0; t < lo[g]; ++t) sg[t] = kNegInf;
    for (int64_t t = hi[g]; t < padded; ++t) sg[t] = kNegInf;
    Vec maxima(kNegInf);
    for (int64_t t = 0; t < padded; t += kW) maxima = at::vec::maximum(maxima, Vec::loadu(sg + t));
    const float group_max = at::vec::vec_reduce_all<float>(
        [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, maxima);
    const float m_new = std::max(m[g], group_max);
    correction[g] = std::exp(m[g] - m_new);  // 0 while m is -inf
    const Vec shift(m_new);
    Vec sums(0.f);
    for (int64_t t = 0; t < padded; t += kW) {
      const Vec p = (Vec::loadu(sg + t) - shift).exp_u20();
      p.store(sg + t);
      sums = sums + p;
    }
    l[g] = l[g] * correction[g] +
           at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sums);
    m[g] = m_new;
  }
}

// `rows` query rows against one group of n cached rows: every row's scores (each cached row
// loaded once for kMaxRows rows at a time), the softmax step, then the weighted latents, a
// column chunk at a time across all rows (the chunk of every cached row stays in L1).
template <typename T>
void attend_group(int64_t rows, const float* q, const T* const* group, int64_t n, const Shape& sh,
                  const int64_t* lo, const int64_t* hi, float* s, float* m, float* l, float* acc,
                  float* correction) {
  const int64_t W = sh.width, L = sh.latent;
  for (int64_t t = 0; t < n; t += 2) {
    const int64_t pair = std::min<int64_t>(2, n - t);
    for (int64_t g = 0; g < rows; g += kMaxRows) {
      with_rows(std::min<int64_t>(kMaxRows, rows - g), [&](auto r) {
        constexpr int R = decltype(r)::value;
        if (pair == 2) {
          score_tile<R, 2, T>(q + g * W, W, group + t, s + g * kGroupTokens + t);
        } else {
          score_tile<R, 1, T>(q + g * W, W, group + t, s + g * kGroupTokens + t);
        }
      });
    }
  }
  softmax_step(rows, n, lo, hi, s, m, l, correction);
  for (int64_t d0 = 0; d0 < L; d0 += 2 * kW) {
    for (int64_t g = 0; g < rows; g += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - g);
      int64_t lo_all = lo[g], hi_all = hi[g];
      for (int64_t i = 1; i < count; ++i) {
        lo_all = std::min(lo_all, lo[g + i]);
        hi_all = std::max(hi_all, hi[g + i]);
      }
      if (lo_all >= hi_all) continue;  // none of these rows sees the group: correction 1
      with_rows(count, [&](auto r) {
        constexpr int R = decltype(r)::value;
        const float* sg = s + g * kGroupTokens;
        float* ag = acc + g * L;
        if (d0 + 2 * kW <= L) {
          accumulate_tile<R, 2, T>(sg, group, lo_all, hi_all, d0, L, correction + g, ag);
        } else {
          int64_t d = d0;
          if (d + kW <= L) {
            accumulate_tile<R, 1, T>(sg, group, lo_all, hi_all, d, L, correction + g, ag);
            d += kW;
          }
          if (d < L) accumulate_tail<R, T>(sg, group, lo_all, hi_all, d, L, correction + g, ag);
        }
      });
    }
  }
}

// The item's query rows (row i * heads + h: its token i, head h), widened and pre-scaled.
template <typename T>
void load_queries(const Item& item, int64_t q_first, const Shape& sh, const T* query, float* q) {
  const int64_t W = sh.width, heads = item.heads;
  for (int64_t i = 0; i < item.q_end - item.q_begin; ++i) {
    const T* token = query + (q_first + item.q_begin + i) * sh.q_token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = token + (item.head + h) * sh.q_head_stride;
      float* dst = q + (i * heads + h) * W;
      for (int64_t d = 0; d < W; ++d) dst[d] = as_float(src[d]) * sh.scale;
    }
  }
}

// The item's rows normalised into `out` [T, heads, L], in the query's dtype.
template <typename T>
void store_outputs(const Item& item, int64_t q_first, const Shape& sh, const Scratch& sc,
                   T* out) {
  const int64_t L = sh.latent, heads = item.heads;
  for (int64_t i = 0; i < item.q_end - item.q_begin; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t r = i * heads + h;
      const float inv = sc.l[r] > 0.f ? 1.f / sc.l[r] : 0.f;
      T* dst = out + ((q_first + item.q_begin + i) * sh.heads + item.head + h) * L;
      for (int64_t d = 0; d < L; ++d) dst[d] = static_cast<T>(sc.acc[r * L + d] * inv);
    }
  }
}

template <typename T>
void run_item(const Item& item, const Shape& sh, const T* query, const T* cache,
              const int32_t* block_table, const int32_t* query_start_loc, const int32_t* seq_lens,
              T* out, Scratch& sc) {
  const int64_t q_first = query_start_loc[item.request];
  const int64_t q_len = query_start_loc[item.request + 1] - q_first;
  const int64_t num_q = item.q_end - item.q_begin, heads = item.heads;
  const int64_t rows = num_q * heads, W = sh.width, bs = sh.block_size;
  sc.reserve(rows, sh);
  load_queries(item, q_first, sh, query, sc.q.data());
  const int64_t pos_first = seq_lens[item.request] - q_len + item.q_begin;
  const int64_t k_hi = pos_first + num_q;  // the tile's last token sees [0, k_hi)
  const int32_t* table = block_table + item.request * sh.max_blocks;
  // A 16-bit cache read by more rows than one pass is widened once a group.
  const bool widen_once = !std::is_same_v<T, float> && rows > kMaxRows;
  const T* group[kGroupTokens];
  const float* widened[kGroupTokens];
  float correction[kMaxItemRows];
  for (int64_t g0 = 0; g0 < k_hi; g0 += kGroupTokens) {
    const int64_t n = std::min(kGroupTokens, k_hi - g0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t k = g0 + t;
      group[t] = cache + (static_cast<int64_t>(table[k / bs]) * bs + k % bs) * W;
    }
    for (int64_t i = 0; i < num_q; ++i) {  // token i sees positions <= pos_first + i
      const int64_t hi = std::min<int64_t>(n, pos_first + i + 1 - g0);
      std::fill(sc.lo.begin() + i * heads, sc.lo.begin() + (i + 1) * heads, 0);
      std::fill(sc.hi.begin() + i * heads, sc.hi.begin() + (i + 1) * heads, std::max<int64_t>(hi, 0));
    }
    if (widen_once) {
      for (int64_t t = 0; t < n; ++t) {
        float* dst = sc.rows.data() + t * W;
        for (int64_t d = 0; d < W; ++d) dst[d] = as_float(group[t][d]);
        widened[t] = dst;
      }
      attend_group<float>(rows, sc.q.data(), widened, n, sh, sc.lo.data(), sc.hi.data(),
                          sc.s.data(), sc.m.data(), sc.l.data(), sc.acc.data(), correction);
    } else {
      attend_group<T>(rows, sc.q.data(), group, n, sh, sc.lo.data(), sc.hi.data(), sc.s.data(),
                      sc.m.data(), sc.l.data(), sc.acc.data(), correction);
    }
  }
  store_outputs(item, q_first, sh, sc, out);
}

// The step's items: each request's query tiles, each with all its heads when the batch alone
// gives every thread work, else with a share of them (a decode at batch 1); at most
// kMaxItemRows rows an item.
std::vector<Item> plan_items(const Shape& sh, const int32_t* query_start_loc, int64_t num_reqs) {
  int64_t tiles = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
    tiles += (std::max<int64_t>(q_len, 0) + kQueryTile - 1) / kQueryTile;
  }
  const int64_t target = 2 * at::get_num_threads();
  const int64_t splits = tiles >= target || tiles == 0 ? 1 : (target + tiles - 1) / tiles;
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
    for (int64_t qb = 0; qb < q_len; qb += kQueryTile) {
      const int64_t qe = std::min(q_len, qb + kQueryTile);
      int64_t per_item = (sh.heads + splits - 1) / splits;
      per_item = std::max<int64_t>(1, std::min(per_item, kMaxItemRows / (qe - qb)));
      for (int64_t h = 0; h < sh.heads; h += per_item) {
        items.push_back({r, h, std::min(per_item, sh.heads - h), qb, qe});
      }
    }
  }
  return items;
}

template <typename T>
void write_rows(const at::Tensor& kv_row, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                const Shape& sh, int64_t num_tokens) {
  T* cache = kv_cache.data_ptr<T>();
  const T* rows = kv_row.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t W = sh.width, capacity = kv_cache.size(0) * sh.block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < capacity, "mla_attention: slot ", slots[t], " of token ", t,
                " is past the cache's ", capacity, " slots");
  }
  OCTAVO_CPU_NAMESPACE::parallel_chunks(num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::copy(rows + t * sh.row_stride, rows + t * sh.row_stride + W, cache + slots[t] * W);
    }
  });
}

template <typename T>
void attend(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
            const at::Tensor& block_table, const at::Tensor& query_start_loc,
            const at::Tensor& seq_lens, const Shape& sh) {
  const int64_t num_reqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<Item> items = plan_items(sh, qsl, num_reqs);
  // Costliest first (a long prompt's last tiles see all its context), so none waits on another.
  const auto cost = [&](const Item& it) {
    const int64_t q_len = qsl[it.request + 1] - qsl[it.request];
    return it.heads * (it.q_end - it.q_begin) * (lens[it.request] - q_len + it.q_end);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const T* q = query.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  OCTAVO_CPU_NAMESPACE::parallel_workers(num_items, [&] {
    Scratch scratch;
    for (int64_t i = next++; i < num_items; i = next++) {
      run_item<T>(items[i], sh, q, cache, table, qsl, lens, o, scratch);
    }
  });
}

void check_inputs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_row,
                  const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                  const at::Tensor& block_table, const at::Tensor& query_start_loc,
                  const at::Tensor& seq_lens, int64_t num_tokens) {
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "mla_attention: float32 or bfloat16, not ", dtype, " (use the torch path)");
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.is_contiguous(),
              "mla_attention: kv_cache must be contiguous [num_blocks, block_size, width]");
  const int64_t W = kv_cache.size(2);
  TORCH_CHECK(query.dim() == 3 && query.size(2) == W && query.stride(2) == 1,
              "mla_attention: query must be [T, heads, width] with contiguous rows");
  TORCH_CHECK(kv_row.dim() == 2 && kv_row.size(1) == W && kv_row.stride(1) == 1,
              "mla_attention: kv_row must be [T, width] with contiguous rows");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.size(0) == query.size(0) &&
                  out.size(1) == query.size(1) && out.size(2) <= W,
              "mla_attention: out must be contiguous [T, heads, kv_lora_rank]");
  TORCH_CHECK(query.scalar_type() == dtype && kv_row.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "mla_attention: out, query, kv_row and kv_cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && slot_mapping.scalar_type() == at::kLong,
              "mla_attention: block_table, query_start_loc and seq_lens must be int32, "
              "slot_mapping int64");
  TORCH_CHECK(block_table.is_contiguous() && query_start_loc.is_contiguous() &&
                  seq_lens.is_contiguous() && slot_mapping.is_contiguous(),
              "mla_attention: the metadata tensors must be contiguous");
  TORCH_CHECK(num_tokens <= slot_mapping.size(0) && num_tokens <= kv_row.size(0),
              "mla_attention: num_tokens ", num_tokens, " exceeds the step's rows");
}

// out[T, H, L] = attention of query[T, H, W] over each request's rows, after writing the step's
// kv_row[T, W] into kv_cache through slot_mapping (-1 skips a token; only the first num_tokens
// are real). Rows of out that no request's tokens cover are zeroed.
void mla_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_row,
                   at::Tensor kv_cache, const at::Tensor& slot_mapping,
                   const at::Tensor& block_table, const at::Tensor& query_start_loc,
                   const at::Tensor& seq_lens, double scale, int64_t num_tokens) {
  check_inputs(out, query, kv_row, kv_cache, slot_mapping, block_table, query_start_loc,
               seq_lens, num_tokens);
  Shape sh;
  sh.heads = query.size(1);
  sh.latent = out.size(2);
  sh.width = kv_cache.size(2);
  sh.block_size = kv_cache.size(1);
  sh.max_blocks = block_table.size(1);
  sh.scale = static_cast<float>(scale);
  sh.q_token_stride = query.stride(0);
  sh.q_head_stride = query.stride(1);
  sh.row_stride = kv_row.stride(0);
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t covered = num_reqs > 0 ? query_start_loc.data_ptr<int32_t>()[num_reqs] : 0;
  TORCH_CHECK(covered <= num_tokens, "mla_attention: the requests' ", covered,
              " tokens exceed num_tokens ", num_tokens);
  out.narrow(0, covered, out.size(0) - covered).zero_();
  if (kv_cache.scalar_type() == at::kFloat) {
    write_rows<float>(kv_row, kv_cache, slot_mapping, sh, num_tokens);
    attend<float>(out, query, kv_cache, block_table, query_start_loc, seq_lens, sh);
  } else {
    write_rows<at::BFloat16>(kv_row, kv_cache, slot_mapping, sh, num_tokens);
    attend<at::BFloat16>(out, query, kv_cache, block_table, query_start_loc, seq_lens, sh);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "mla_attention(Tensor(a!) out, Tensor query, Tensor kv_row, Tensor(b!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
      "float scale, SymInt num_tokens) -> ()");
  m.impl("mla_attention", c10::DispatchKey::CPU, &mla_attention);
}

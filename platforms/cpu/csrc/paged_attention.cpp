// Paged attention for the cpu platform: the whole mixed batch (prefill chunks and decodes) in
// one call that reads K/V where they lie, through the block table.
//
// KV cache layout (the cpu backend's): [2, num_blocks, num_kv_heads, block_size, head_dim], where
// one KV head's tokens of one block are a contiguous tile: V's is [block_size][head_dim], K's is
// stored transposed, [head_dim][block_size], so a query's scores against a block are
// block_size-wide vector FMAs. fp32 K/V are read in place, and so are 16-bit ones for a
// decode's few query rows (widened in registers); a prefill tile widens its tiles once.
//
// Work is split into items (request, one KV head or all of them, a tile of query tokens, a range
// of the context).
// The query heads that share a KV head, at up to a few consecutive positions, are processed
// together, so each K/V vector is loaded once for all of them (for a prefill chunk this is a
// small register-blocked GEMM). Softmax is online, in fp32. Threads claim items costliest first.
// When the batch alone cannot keep every thread busy (a decode at batch 1), the context is split
// into ranges whose partial results (accumulator, running max, running sum) are merged
// afterwards: split-KV. Decodes whose block tables begin with the same blocks (a prompt prefix
// shared through prefix caching) attend those blocks together first (cascade attention).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

constexpr int64_t kQueryTile = 16;       // query tokens of one request per work item
constexpr int64_t kMinSplitTokens = 256;  // a context range of a split item is at least this long

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t window;  // sliding window in tokens, or <= 0 for none
  float scale;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens' rows
};

struct Item {
  int64_t request, kv_head, kv_heads;       // KV heads [kv_head, kv_head + kv_heads)
  int64_t q_begin, q_end;                    // query tokens, relative to the request's first
  int64_t k_begin, k_end;                    // context positions this item attends to
  int64_t partial;                           // index into the partial buffers, or -1 (direct)
  int64_t prefix_slot;  // where its shared prefix's state is (a cascade member), or -1
};

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = as_float(src[i]);
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

inline void scale_row(float alpha, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

// Context is attended a group of blocks at a time (about kGroupTokens tokens), so the online
// softmax's rescaling (an exp and a pass over the accumulator) is paid once per group, not per
// block: with block size 1 a group is 64 blocks.
constexpr int64_t kGroupTokens = 64;

// Rows attended together: the query heads of one KV head at consecutive positions of a
// request, each K and V vector loaded once for all of them. Eight keep the sums in AVX-512's 32
// registers; AVX2's 16 hold four.
constexpr int kMaxRows = at::vec::Vectorized<float>::size() >= 16 ? 8 : 4;

inline int64_t blocks_per_group(int64_t block_size) {
  return std::max<int64_t>(1, kGroupTokens / block_size);
}

// Tiles a work item reads next, asked for ahead (a hint: no fault, no wait). The blocks lie
// wherever the allocator put them, beyond the hardware prefetcher's reach. A decode asks for the
// next KV head's tiles (or the next group's) a few cache lines at a time from inside the
// kernels' loops, into L2, so that they arrive while it computes: asked for a whole group at
// once, the lines stalled on the few misses a core keeps in flight with nothing computed
// meanwhile (decode attention at ~5 GB/s a thread), and in L1 they pushed out the tiles in use.
// Many rows' passes (a prefill tile) ask for the next group's tiles at once: their arithmetic
// hides the misses, and asking from their loops cost more than it won.
struct Ahead {
  static constexpr int64_t kLine = 64;
  const char* regions[2 * kGroupTokens];  // K regions, then V regions
  int64_t count = 0, lines_per_region = 0, per_step = 0;
  int64_t region = 0, line = 0;  // the next line to ask for

  // KV heads [kv_head, kv_head + heads) (adjacent in a block) in blocks table[from .. + blocks).
  template <typename T>
  void set(const int32_t* table, int64_t from, int64_t blocks, int64_t kv_head, int64_t heads,
           const Shape& sh, const T* k_cache, const T* v_cache) {
    const int64_t tile_size = sh.block_size * sh.head_dim;
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t at = (table[from + j] * sh.num_kv_heads + kv_head) * tile_size;
      regions[j] = reinterpret_cast<const char*>(k_cache + at);
      regions[blocks + j] = reinterpret_cast<const char*>(v_cache + at);
    }
    count = 2 * blocks;
    lines_per_region = (heads * tile_size * static_cast<int64_t>(sizeof(T)) + kLine - 1) / kLine;
    region = line = per_step = 0;
  }
  void clear() { count = region = line = per_step = 0; }
  // Spread what is left over about `steps` calls of step().
  void pace(int64_t steps) {
    const int64_t left = (count - region) * lines_per_region - line;
    per_step = left > 0 ? (left + steps - 1) / std::max<int64_t>(steps, 1) : 0;
  }
  inline void step() {
    for (int64_t i = 0; i < per_step && region < count; ++i) {
      __builtin_prefetch(regions[region] + line * kLine, 0, 2);  // prefetcht1: into L2
      if (++line == lines_per_region) {
        line = 0;
        ++region;
      }
    }
  }
  // Whatever is left, now.
  void finish() {
    for (; region < count; ++region, line = 0) {
      for (; line < lines_per_region; ++line) {
        __builtin_prefetch(regions[region] + line * kLine, 0, 3);  // prefetcht0
      }
    }
  }
};

// The per-thread scratch of one work item: the query rows, their running state, the scores of
// one group, and for 16-bit caches read by more rows than one pass one group of K and V tiles
// widened to fp32.
struct Scratch {
  std::vector<float> q, acc, m, l, k, v, s;
  std::vector<int64_t> lo, hi;  // each row's visible range of the current group
  void reserve(int64_t rows, const Shape& shape) {
    const int64_t width = at::vec::Vectorized<float>::size();
    const int64_t group = blocks_per_group(shape.block_size) * shape.block_size;
    q.resize(rows * shape.head_dim);
    acc.assign(rows * shape.head_dim, 0.f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.f);
    k.resize(group * shape.head_dim);
    v.resize(group * shape.head_dim);
    s.resize(kMaxRows * ((group + width - 1) / width * width));
    lo.resize(rows);
    hi.resize(rows);
  }
};

// Vector accumulators a kernel below keeps in registers: with the loaded K or V vectors beside
// them they fit AVX-512's 32 registers (AVX2's 16), and there are enough independent sums that
// the FMAs never wait on one another's latency. AVX2 keeps 8 sums (with the loads, 13 of its 16
// registers): 4-row tiles (prefill's, and decodes of 4 query heads a KV head) 2 vectors a row
// (with 1 a row prefill ran ~20% slower on Zen 1), 2-row ones (decodes of 2 query heads a KV
// head) 4: a head_dim of 32 in one pass over the values, where 3 a row took a second pass for
// the last vector (decode attention ~10% faster on Zen 1). AVX-512 keeps 16 (with the loads at
// most 25 of its 32): 8-row tiles (prefill's) 2 vectors a row, where 12 gave them 1 and each
// K or V vector loaded fed only 8 FMAs beside 8 broadcasts (prefill of the small model's shapes,
// one thread on the AMX host: ~12% faster, fp32 and bf16).
constexpr int kAccumulators = at::vec::Vectorized<float>::size() >= 16 ? 16 : 8;
constexpr int kMinVectorsPerRow = at::vec::Vectorized<float>::size() >= 16 ? 1 : 2;

constexpr int clamp_width(int width, int most) {
  return width < 1 ? 1 : (width > most ? most : width);
}

template <int R>
constexpr int kVectorsPerRow = std::max(kAccumulators / R, kMinVectorsPerRow);

// For R query rows: vectors of tokens scored at once (score_vectors), vectors of head_dim
// accumulated at once (accumulate_values).
template <int R>
constexpr int kScoreVectors = clamp_width(kVectorsPerRow<R>, 8);
template <int R>
constexpr int kValueVectors = clamp_width(kVectorsPerRow<R>, 4);

// Scores of R query rows against C vectors of W tokens, vector c being W adjacent columns of a
// K tile (k[c] + d * n is its row d): into s[g * padded + at[c] ..]. With kAhead, `ahead` is
// stepped once a row (a compile-time choice: a test in the loop slowed prefill tiles ~15%).
template <int R, int C, bool kAhead, typename T>
inline void score_vectors(const float* q, const T* const* k, const int64_t* at, int64_t n,
                          int64_t D, float* s, int64_t padded, Ahead* ahead) {
  using Vec = at::vec::Vectorized<float>;
  Vec sum[R][C];
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < C; ++c) sum[g][c] = Vec(0.f);
  }
  for (int64_t d = 0; d < D; ++d) {
    if constexpr (kAhead) ahead->step();
    Vec kv[C];
    for (int c = 0; c < C; ++c) kv[c] = widen::load(k[c] + d * n);
    for (int g = 0; g < R; ++g) {
      const Vec qd(q[g * D + d]);
      for (int c = 0; c < C; ++c) sum[g][c] = at::vec::fmadd(qd, kv[c], sum[g][c]);
    }
  }
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < C; ++c) sum[g][c].store(s + g * padded + at[c]);
  }
}

// The scores of R rows against a group's nb K tiles kt[j][D][n]: s[g * padded + j * n + t].
template <int R, typename T>
inline void score_group(const float* q, const T* const* kt, int64_t nb, int64_t n, int64_t D,
                        float* s, int64_t padded, Ahead* ahead) {
  constexpr int64_t W = at::vec::Vectorized<float>::size();
  if (n % W != 0) {  // a block narrower than a vector (block size 1, say): one score at a time
    for (int64_t j = 0; j < nb; ++j) {
      for (int g = 0; g < R; ++g) {
        for (int64_t t = 0; t < n; ++t) {
          if (ahead) ahead->step();
          float score = 0.f;
#pragma omp simd reduction(+ : score)
          for (int64_t d = 0; d < D; ++d) score += q[g * D + d] * as_float(kt[j][d * n + t]);
          s[g * padded + j * n + t] = score;
        }
      }
    }
    return;
  }
  constexpr int C = kScoreVectors<R>;
  const auto score = [&](auto width, const T* const* k, const int64_t* at) {
    constexpr int c = decltype(width)::value;
    if (ahead) {
      score_vectors<R, c, true, T>(q, k, at, n, D, s, padded, ahead);
    } else {
      score_vectors<R, c, false, T>(q, k, at, n, D, s, padded, ahead);
    }
  };
  const T* k[C];
  int64_t at[C];
  int filled = 0;
  for (int64_t j = 0; j < nb; ++j) {
    for (int64_t t = 0; t < n; t += W) {
      k[filled] = kt[j] + t;
      at[filled] = j * n + t;
      if (++filled == C) {
        score(std::integral_constant<int, C>(), k, at);
        filled = 0;
      }
    }
  }
  // The last vectors in as few calls as can be: a group narrower than C vectors is all last
  // vectors (a group is 64 tokens, 4 vectors on AVX-512, whatever the block size up to 64: a
  // 2-row decode, C = 8, had scored them one at a time, each K vector loaded for 2 FMAs).
  int c = 0;
  if constexpr (C >= 4) {
    for (; c + 4 <= filled; c += 4) score(std::integral_constant<int, 4>(), k + c, at + c);
  }
  if constexpr (C >= 2) {
    for (; c + 2 <= filled; c += 2) score(std::integral_constant<int, 2>(), k + c, at + c);
  }
  for (; c < filled; ++c) score(std::integral_constant<int, 1>(), k + c, at + c);
}

// Columns [d0, d0 + P * W) of R accumulator rows: acc = acc * correction + p . V over the
// group's tokens [lo, hi), V rows vf[j][n][D], p the rows' probabilities s[g * padded + ..].
// With kAhead, `ahead` is stepped once a token.
template <int R, int P, bool kAhead, typename T>
inline void accumulate_values(const float* s, int64_t padded, const T* const* vf, int64_t n,
                              int64_t D, int64_t d0, int64_t lo, int64_t hi,
                              const float* correction, float* acc, Ahead* ahead) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  Vec sum[R][P];
  for (int g = 0; g < R; ++g) {
    const Vec scale(correction[g]);
    for (int c = 0; c < P; ++c) sum[g][c] = Vec::loadu(acc + g * D + d0 + c * W) * scale;
  }
  for (int64_t j = lo / n; j * n < hi; ++j) {
    const int64_t t1 = std::min(hi - j * n, n);
    const float* p = s + j * n;
    for (int64_t t = std::max<int64_t>(lo - j * n, 0); t < t1; ++t) {
      if constexpr (kAhead) ahead->step();
      const T* row = vf[j] + t * D + d0;
      Vec v[P];
      for (int c = 0; c < P; ++c) v[c] = widen::load(row + c * W);
      for (int g = 0; g < R; ++g) {
        const Vec pg(p[g * padded + t]);
        for (int c = 0; c < P; ++c) sum[g][c] = at::vec::fmadd(pg, v[c], sum[g][c]);
      }
    }
  }
  for (int g = 0; g < R; ++g) {
    for (int c = 0; c < P; ++c) sum[g][c].store(acc + g * D + d0 + c * W);
  }
}

// acc = acc * correction + p . V for every column of R rows: whole vectors P at a time, then one
// at a time, then a head_dim's last partial vector element by element.
template <int R, typename T>
inline void accumulate_group(const float* s, int64_t padded, const T* const* vf, int64_t n,
                             int64_t D, int64_t lo, int64_t hi, const float* correction,
                             float* acc, Ahead* ahead) {
  constexpr int64_t W = at::vec::Vectorized<float>::size();
  constexpr int P = kValueVectors<R>;
  const auto accumulate = [&](auto width, int64_t d0) {
    constexpr int p = decltype(width)::value;
    if (ahead) {
      accumulate_values<R, p, true, T>(s, padded, vf, n, D, d0, lo, hi, correction, acc, ahead);
    } else {
      accumulate_values<R, p, false, T>(s, padded, vf, n, D, d0, lo, hi, correction, acc, ahead);
    }
  };
  int64_t d0 = 0;
  for (; d0 + P * W <= D; d0 += P * W) accumulate(std::integral_constant<int, P>(), d0);
  // A head_dim narrower than P vectors (32 on AVX-512, 2 vectors) two at a time, not one at a
  // time in two passes (each pass loading every probability again). With the scoring above:
  // decode attention of the tiny model's shapes ~20% faster (one thread, the AMX host).
  if constexpr (P > 2) {
    for (; d0 + 2 * W <= D; d0 += 2 * W) accumulate(std::integral_constant<int, 2>(), d0);
  }
  for (; d0 + W <= D; d0 += W) accumulate(std::integral_constant<int, 1>(), d0);
  for (int g = 0; g < R && d0 < D; ++g) {
    for (int64_t d = d0; d < D; ++d) {
      float sum = acc[g * D + d] * correction[g];
      for (int64_t t = lo; t < hi; ++t) {
        sum += s[g * padded + t] * as_float(vf[t / n][(t % n) * D + d]);
      }
      acc[g * D + d] = sum;
    }
  }
}

// R query rows (query heads of one KV head, at one or a few consecutive positions) against one
// group of nb blocks (nb * n tokens, n = block_size), of which row g sees tokens [lo[g], hi[g])
// (group offsets; none when lo[g] >= hi[g]): scores from each block's K tile kt[j][D][n], one
// online-softmax update per row, and the V rows vf[j][n][D] accumulated. The scores and the
// accumulation are register-blocked (score_group, accumulate_group): each K or V vector is
// loaded once for all R rows. q, acc: R rows of D; m, l: R values; s: R rows of the group's
// padded width.
template <int R, typename T>
inline void attend_group(const float* q, const T* const* kt, const T* const* vf,
                         int64_t nb, int64_t n, int64_t D, const int64_t* lo, const int64_t* hi,
                         float* s, float* m, float* l, float* acc, Ahead* ahead) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t total = nb * n;
  const int64_t padded = (total + W - 1) / W * W;
  {  // the kernels' loop steps, roughly, over which to spread the next tiles' lines
    constexpr int C = kScoreVectors<R>, P = kValueVectors<R>;
    const int64_t vectors = total / W;
    const int64_t score_steps = n % W == 0 ? D * (vectors / C + vectors % C) : R * total;
    if (ahead) ahead->pace(score_steps + total * std::max<int64_t>(1, D / (P * W)));
  }
  score_group<R, T>(q, kt, nb, n, D, s, padded, ahead);
  float correction[R];
  for (int g = 0; g < R; ++g) {
    float* sg = s + g * padded;
    if (lo[g] >= hi[g]) {  // this row sees none of the group (a causal tile's early token)
      std::fill(sg, sg + padded, 0.f);
      correction[g] = 1.f;
      continue;
    }
    for (int64_t t = 0; t < lo[g]; ++t) sg[t] = kNegInf;
    for (int64_t t = hi[g]; t < padded; ++t) sg[t] = kNegInf;  // the invisible tail and padding
    Vec maxima(kNegInf);
    for (int64_t t = 0; t < padded; t += W) maxima = at::vec::maximum(maxima, Vec::loadu(sg + t));
    const float group_max = at::vec::vec_reduce_all<float>(
        [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, maxima);
    const float m_new = std::max(m[g], group_max);
    correction[g] = std::exp(m[g] - m_new);  // 0 while m is -inf
    // p = exp(s - m_new), vectorised (ATen's exp_u20, as torch's own flash attention uses);
    // masked scores are -inf and give 0.
    const Vec shift(m_new);
    Vec sums(0.f);
    for (int64_t t = 0; t < padded; t += W) {
      const Vec p = (Vec::loadu(sg + t) - shift).exp_u20();
      p.store(sg + t);
      sums = sums + p;
    }
    l[g] = l[g] * correction[g] +
           at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sums);
    m[g] = m_new;
  }
  int64_t lo_all = lo[0], hi_all = hi[0];  // the rows' visible ranges together
  for (int g = 1; g < R; ++g) {
    lo_all = std::min(lo_all, lo[g]);
    hi_all = std::max(hi_all, hi[g]);
  }
  accumulate_group<R, T>(s, padded, vf, n, D, lo_all, hi_all, correction, acc, ahead);
}

// `rows` query rows (each with its visible range [lo, hi) of the group) in chunks of at most
// kMaxRows, one instantiation per chunk size.
template <typename T>
inline void attend_rows(int64_t rows, const float* q, const T* const* kt, const T* const* vf,
                        int64_t nb, int64_t n, int64_t D, const int64_t* lo, const int64_t* hi,
                        float* s, float* m, float* l, float* acc, Ahead* ahead) {
  for (int64_t g = 0; g < rows;) {
    const int64_t count = std::min<int64_t>(kMaxRows, rows - g);
    const float* qg = q + g * D;
    float* ag = acc + g * D;
    const int64_t *lg = lo + g, *hg = hi + g;
    switch (count) {
#define OCTAVO_ATTEND_CASE(k) \
  case k: attend_group<k, T>(qg, kt, vf, nb, n, D, lg, hg, s, m + g, l + g, ag, ahead); break;
      OCTAVO_ATTEND_CASE(8)
      OCTAVO_ATTEND_CASE(7)
      OCTAVO_ATTEND_CASE(6)
      OCTAVO_ATTEND_CASE(5)
      OCTAVO_ATTEND_CASE(4)
      OCTAVO_ATTEND_CASE(3)
      OCTAVO_ATTEND_CASE(2)
#undef OCTAVO_ATTEND_CASE
      default: attend_group<1, T>(qg, kt, vf, nb, n, D, lg, hg, s, m + g, l + g, ag, ahead); break;
    }
    g += count;
  }
}

// The query heads of KV head `kv_head` at row `token` of `query`: G rows of D, pre-scaled.
template <typename T>
inline void load_query_rows(const T* query, int64_t token, int64_t kv_head, const Shape& sh,
                            float* dst) {
  const int64_t D = sh.head_dim;
  const T* src = query + token * sh.q_stride + kv_head * sh.group * D;
  for (int64_t g = 0; g < sh.group; ++g) {
    load_row(src + g * D, dst + g * D, D);
    scale_row(sh.scale, dst + g * D, D);
  }
}

// Rows of one KV head `kv_head` (q, lo, hi, m, l, acc as attend_rows takes them) against its
// tiles in blocks table[b .. b + nb). A float32 cache is read in place; so is a 16-bit one when
// the rows fit in one pass of attend_group (a decode's query heads: each tile is widened in
// registers as it is read). More rows than that (a prefill tile) would widen each tile once
// per pass: for them the tiles are widened once into the scratch. `ahead`, if any, is asked
// for the tiles read next from inside the loops.
template <typename T>
inline void attend_tiles(const int32_t* table, int64_t b, int64_t nb, int64_t kv_head,
                         int64_t rows, const float* q, const int64_t* lo, const int64_t* hi,
                         float* m, float* l, float* acc, const Shape& sh, const T* k_cache,
                         const T* v_cache, Scratch& scratch, Ahead* ahead) {
  const int64_t tile_size = sh.block_size * sh.head_dim;
  const auto tile = [&](int64_t j) {
    return (table[b + j] * sh.num_kv_heads + kv_head) * tile_size;
  };
  if (std::is_same_v<T, float> || rows <= kMaxRows) {
    const T* kt[kGroupTokens];
    const T* vf[kGroupTokens];
    for (int64_t j = 0; j < nb; ++j) {
      kt[j] = k_cache + tile(j);
      vf[j] = v_cache + tile(j);
    }
    attend_rows<T>(rows, q, kt, vf, nb, sh.block_size, sh.head_dim, lo, hi, scratch.s.data(), m,
                   l, acc, ahead);
    return;
  }
  const float* kt[kGroupTokens];
  const float* vf[kGroupTokens];
  for (int64_t j = 0; j < nb; ++j) {
    float* k = scratch.k.data() + j * tile_size;
    float* v = scratch.v.data() + j * tile_size;
    load_row(k_cache + tile(j), k, tile_size);
    load_row(v_cache + tile(j), v, tile_size);
    kt[j] = k;
    vf[j] = v;
  }
  attend_rows<float>(rows, q, kt, vf, nb, sh.block_size, sh.head_dim, lo, hi, scratch.s.data(),
                     m, l, acc, ahead);
}

template <typename T>
void run_item(const Item& item, const Shape& sh, const T* query, T* out, const T* k_cache,
              const T* v_cache, const int32_t* block_table, const int32_t* query_start_loc,
              const int32_t* seq_lens, float* partial_acc, float* partial_ml,
              const float* prefix_acc, const float* prefix_ml, Scratch& scratch) {
  const int64_t D = sh.head_dim, G = sh.group, bs = sh.block_size;
  const int64_t q_first = query_start_loc[item.request];
  const int64_t q_len = query_start_loc[item.request + 1] - q_first;
  const int64_t seq_len = seq_lens[item.request];
  const int64_t num_q = item.q_end - item.q_begin;
  const int64_t rows = num_q * G;  // per KV head
  const int64_t H = item.kv_heads;
  scratch.reserve(rows * H, sh);
  float* q = scratch.q.data();
  float* acc = scratch.acc.data();
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  if (item.prefix_slot >= 0) {  // go on from the shared prefix's state (k_begin is its end)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t from = (item.prefix_slot * sh.num_kv_heads + item.kv_head + h) * G + g;
        const int64_t r = h * rows + g;  // a member is a decode: one query token
        std::copy(prefix_acc + from * D, prefix_acc + (from + 1) * D, acc + r * D);
        m[r] = prefix_ml[2 * from];
        l[r] = prefix_ml[2 * from + 1];
      }
    }
  }
  // Query rows: KV head h of the item, token i of the tile, head g of the KV head's group,
  // pre-scaled.
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < num_q; ++i) {
      load_query_rows(query, q_first + item.q_begin + i, item.kv_head + h, sh,
                      q + (h * num_q + i) * G * D);
    }
  }
  // Positions of the tile's first and last query tokens.
  const int64_t pos_first = seq_len - q_len + item.q_begin;
  const int64_t pos_last = seq_len - q_len + item.q_end - 1;
  int64_t k_lo = item.k_begin, k_hi = std::min(item.k_end, pos_last + 1);
  if (sh.window > 0) k_lo = std::max(k_lo, pos_first - sh.window + 1);
  const int32_t* table = block_table + item.request * sh.max_blocks;
  const int64_t group = blocks_per_group(bs);
  const int64_t last_block = (k_hi + bs - 1) / bs;
  Ahead ahead;
  for (int64_t b = k_lo / bs; b < last_block; b += group) {
    const int64_t nb = std::min(group, last_block - b);
    // Each row's visible part of the group; the tokens that see none of it (the tile's first,
    // against the diagonal's far side, or past a sliding window) are left out at either end.
    const int64_t b0 = b * bs;
    int64_t first = num_q, last = -1;
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t pos = pos_first + i;
      int64_t lo = std::max<int64_t>(0, k_lo - b0);
      const int64_t hi = std::min(nb * bs, std::min(k_hi, pos + 1) - b0);
      if (sh.window > 0) lo = std::max<int64_t>(lo, pos - sh.window + 1 - b0);
      for (int64_t g = 0; g < G; ++g) {
        scratch.lo[i * G + g] = lo;
        scratch.hi[i * G + g] = hi;
      }
      if (lo < hi) {
        first = std::min(first, i);
        last = i;
      }
    }
    if (last < 0) continue;
    const int64_t visible_rows = (last + 1 - first) * G;
    const bool paced = visible_rows <= kMaxRows;  // see Ahead
    const int64_t next_nb = std::min(group, last_block - b - nb);
    if (!paced && next_nb > 0) {  // the next group's tiles, all KV heads, at once
      ahead.set(table, b + nb, next_nb, item.kv_head, H, sh, k_cache, v_cache);
      ahead.finish();
    }
    for (int64_t h = 0; h < H; ++h) {
      if (!paced) {
        ahead.clear();
      } else if (h + 1 < H) {  // read next: the next KV head's tiles of this group
        ahead.set(table, b, nb, item.kv_head + h + 1, 1, sh, k_cache, v_cache);
      } else if (next_nb > 0) {  // or the next group's first KV head's
        ahead.set(table, b + nb, next_nb, item.kv_head, 1, sh, k_cache, v_cache);
      } else {
        ahead.clear();
      }
      const int64_t r = h * rows + first * G;
      attend_tiles(table, b, nb, item.kv_head + h, visible_rows, q + r * D,
                   scratch.lo.data() + first * G, scratch.hi.data() + first * G, m + r, l + r,
                   acc + r * D, sh, k_cache, v_cache, scratch, paced ? &ahead : nullptr);
      ahead.finish();
    }
  }
  if (item.partial < 0) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < num_q; ++i) {
        T* dst =
            out + ((q_first + item.q_begin + i) * sh.num_heads + (item.kv_head + h) * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (h * num_q + i) * G + g;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) dst[g * D + d] = static_cast<T>(acc[r * D + d] * inv);
        }
      }
    }
    return;
  }
  float* pa = partial_acc + item.partial * kQueryTile * G * D;
  float* pml = partial_ml + item.partial * kQueryTile * G * 2;
  std::copy(acc, acc + rows * D, pa);
  for (int64_t r = 0; r < rows; ++r) {
    pml[2 * r] = m[r];
    pml[2 * r + 1] = l[r];
  }
}

// Cascade attention: decodes whose block tables begin with the same blocks (a prompt prefix they
// share through prefix caching) attend those blocks together, per KV head, each K/V tile loaded
// once for many query rows (and from cache after the first); each then goes on from that state
// over its own blocks. The shared part ends on a group boundary, so every row sees the same
// groups in the same order as without it: the results are the same bits.
constexpr int64_t kMinCascadeRequests = 8;  // fewer decodes sharing a prefix: attend it apart
constexpr int64_t kCascadeChunk = 16;       // members per prefix work item

struct SharedPrefix {
  std::vector<int64_t> requests;  // its members, in slot order
  int64_t first_slot;             // the first member's slot
  int64_t num_blocks;             // shared leading blocks, a whole number of groups
};

struct Cascade {
  std::vector<SharedPrefix> prefixes;
  std::vector<int64_t> slot;           // per request: its place among all members, or -1
  std::vector<int64_t> prefix_tokens;  // per request: the tokens its shared prefix covers
  int64_t num_members = 0;
};

Cascade plan_cascade(const Shape& sh, const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* block_table, int64_t num_reqs) {
  Cascade cascade;
  cascade.slot.assign(num_reqs, -1);
  cascade.prefix_tokens.assign(num_reqs, 0);
  const int64_t group = blocks_per_group(sh.block_size);
  std::vector<int64_t> decodes;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const bool decode = query_start_loc[r + 1] - query_start_loc[r] == 1;
    if (decode && (seq_lens[r] - 1) / sh.block_size >= group) decodes.push_back(r);
  }
  if (sh.window > 0 || static_cast<int64_t>(decodes.size()) < kMinCascadeRequests) {
    return cascade;
  }
  const auto first_block = [&](int64_t r) { return block_table[r * sh.max_blocks]; };
  std::stable_sort(decodes.begin(), decodes.end(),
                   [&](int64_t a, int64_t b) { return first_block(a) < first_block(b); });
  const int64_t n = static_cast<int64_t>(decodes.size());
  for (int64_t i = 0, j; i < n; i = j) {
    for (j = i + 1; j < n && first_block(decodes[j]) == first_block(decodes[i]); ++j) {
    }
    if (j - i < kMinCascadeRequests) continue;
    const int32_t* lead = block_table + decodes[i] * sh.max_blocks;
    int64_t shared = sh.max_blocks;
    for (int64_t k = i; k < j; ++k) {  // blocks wholly before each member's new token
      const int32_t* row = block_table + decodes[k] * sh.max_blocks;
      const int64_t limit = std::min(shared, (seq_lens[decodes[k]] - 1) / sh.block_size);
      int64_t p = 0;
      while (p < limit && row[p] == lead[p]) ++p;
      shared = p;
    }
    shared = shared / group * group;
    if (shared == 0) continue;
    SharedPrefix prefix{{}, cascade.num_members, shared};
    for (int64_t k = i; k < j; ++k) {
      prefix.requests.push_back(decodes[k]);
      cascade.slot[decodes[k]] = cascade.num_members++;
      cascade.prefix_tokens[decodes[k]] = shared * sh.block_size;
    }
    cascade.prefixes.push_back(std::move(prefix));
  }
  return cascade;
}

// Members [begin, end) of `prefix` against its shared blocks, KV head `kv_head`: their running
// state (accumulator, max, sum) into the prefix buffers at their slots.
template <typename T>
void run_prefix(const SharedPrefix& prefix, int64_t kv_head, int64_t begin, int64_t end,
                const Shape& sh, const T* query, const T* k_cache, const T* v_cache,
                const int32_t* block_table, const int32_t* query_start_loc, float* prefix_acc,
                float* prefix_ml, Scratch& scratch) {
  const int64_t D = sh.head_dim, G = sh.group, bs = sh.block_size;
  const int64_t rows = (end - begin) * G;
  scratch.reserve(rows, sh);
  float* q = scratch.q.data();
  for (int64_t i = begin; i < end; ++i) {
    load_query_rows(query, query_start_loc[prefix.requests[i]], kv_head, sh,
                    q + (i - begin) * G * D);
  }
  const int32_t* table = block_table + prefix.requests[0] * sh.max_blocks;
  const int64_t group = blocks_per_group(bs);
  Ahead ahead;
  for (int64_t b = 0; b < prefix.num_blocks; b += group) {
    if (b + group < prefix.num_blocks) {  // the next group's tiles, all at once (many rows)
      ahead.set(table, b + group, std::min(group, prefix.num_blocks - b - group), kv_head, 1, sh,
                k_cache, v_cache);
      ahead.finish();
    }
    std::fill(scratch.lo.begin(), scratch.lo.begin() + rows, 0);
    std::fill(scratch.hi.begin(), scratch.hi.begin() + rows, group * bs);
    attend_tiles(table, b, group, kv_head, rows, q, scratch.lo.data(), scratch.hi.data(),
                 scratch.m.data(), scratch.l.data(), scratch.acc.data(), sh, k_cache, v_cache,
                 scratch, nullptr);
  }
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - begin) * G + g;
      const int64_t to = ((prefix.first_slot + i) * sh.num_kv_heads + kv_head) * G + g;
      std::copy(scratch.acc.begin() + r * D, scratch.acc.begin() + (r + 1) * D,
                prefix_acc + to * D);
      prefix_ml[2 * to] = scratch.m[r];
      prefix_ml[2 * to + 1] = scratch.l[r];
    }
  }
}

// Merge the partial results of one (request, KV head, query tile) split over context ranges.
template <typename T>
void merge_items(const std::vector<Item>& items, int64_t first, int64_t count, const Shape& sh,
                 T* out, const int32_t* query_start_loc, const float* partial_acc,
                 const float* partial_ml) {
  const Item& head = items[first];
  const int64_t D = sh.head_dim, G = sh.group;
  const int64_t num_q = head.q_end - head.q_begin;
  const int64_t q_first = query_start_loc[head.request];
  std::vector<float> merged(D);
  for (int64_t i = 0; i < num_q; ++i) {
    T* dst = out + ((q_first + head.q_begin + i) * sh.num_heads + head.kv_head * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float m_all = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < count; ++j) {
        m_all = std::max(m_all, partial_ml[(items[first + j].partial * kQueryTile * G + r) * 2]);
      }
      std::fill(merged.begin(), merged.end(), 0.f);
      float l_all = 0.f;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t p = items[first + j].partial;
        const float mj = partial_ml[(p * kQueryTile * G + r) * 2];
        const float lj = partial_ml[(p * kQueryTile * G + r) * 2 + 1];
        if (lj == 0.f) continue;
        const float w = std::exp(mj - m_all);
        l_all += lj * w;
        axpy(w, partial_acc + (p * kQueryTile * G + r) * D, merged.data(), D);
      }
      const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[g * D + d] = static_cast<T>(merged[d] * inv);
    }
  }
}

// The work items of one call, and where split items' partial results go. Items of one split
// group are consecutive; `groups` holds (first item, count) of each split group.
struct Plan {
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> groups;
  int64_t num_partials = 0;
};

Plan plan_items(const Shape& sh, const int32_t* query_start_loc, const int32_t* seq_lens,
                int64_t num_reqs, const Cascade& cascade) {
  Plan plan;
  int64_t base_items = 0;
  int64_t total_cost = 0, max_tile_cost = 0;  // query tokens x the context they attend
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
    base_items += sh.num_kv_heads * ((q_len + kQueryTile - 1) / kQueryTile);
    for (int64_t qb = 0; qb < q_len; qb += kQueryTile) {
      const int64_t qe = std::min(q_len, qb + kQueryTile);
      const int64_t cost = (qe - qb) * (seq_lens[r] - q_len + qe);
      total_cost += cost;
      max_tile_cost = std::max(max_tile_cost, cost);
    }
  }
  const int64_t target = 2 * at::get_num_threads();
  // With work enough for every thread, and none of it in one item too large to share out
  // (a long context beside short ones), an item takes all of a request's KV heads: it then
  // reads each block's K and V whole (contiguous), which the hardware prefetcher streams
  // (a decode step at batch 32: attention ~18% faster than one item per KV head). Otherwise
  // an item takes one KV head, and only then is a context split (base_items < target).
  const bool all_heads =
      base_items >= target * sh.num_kv_heads && max_tile_cost * target <= total_cost;
  const int64_t heads_per_item = all_heads ? sh.num_kv_heads : 1;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = query_start_loc[r + 1] - query_start_loc[r];
    if (q_len <= 0) continue;
    const int64_t seq_len = seq_lens[r];
    for (int64_t qb = 0; qb < q_len; qb += kQueryTile) {
      const int64_t qe = std::min(q_len, qb + kQueryTile);
      const int64_t context = seq_len - q_len + qe;  // keys the tile's last token sees
      int64_t splits = 1;
      const int64_t slot = cascade.slot[r];
      if (slot < 0 && base_items < target && base_items > 0) {
        splits = std::min((target + base_items - 1) / base_items, context / kMinSplitTokens);
        splits = std::max<int64_t>(splits, 1);
      }
      int64_t range = (context + splits - 1) / splits;
      range = ((range + sh.block_size - 1) / sh.block_size) * sh.block_size;
      for (int64_t h = 0; h < sh.num_kv_heads; h += heads_per_item) {
        if (splits == 1) {
          plan.items.push_back(
              {r, h, heads_per_item, qb, qe, cascade.prefix_tokens[r], context, -1, slot});
          continue;
        }
        const int64_t first = static_cast<int64_t>(plan.items.size());
        for (int64_t k0 = 0; k0 < context; k0 += range) {
          plan.items.push_back({r, h, 1, qb, qe, k0, std::min(context, k0 + range),
                                plan.num_partials++, -1});
        }
        plan.groups.emplace_back(first, static_cast<int64_t>(plan.items.size()) - first);
      }
    }
  }
  return plan;
}

// An item's work, roughly: its query tokens times the context they attend.
inline int64_t item_cost(const Item& item) {
  return item.kv_heads * (item.q_end - item.q_begin) * (item.k_end - item.k_begin);
}

template <typename T>
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, const Shape& sh, int64_t num_tokens) {
  const int64_t D = sh.head_dim, bs = sh.block_size, KVH = sh.num_kv_heads;
  const int64_t num_blocks = kv_cache.size(1);
  T* k_cache = kv_cache.data_ptr<T>();
  T* v_cache = k_cache + num_blocks * KVH * bs * D;
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  OCTAVO_CPU_NAMESPACE::parallel_chunks(num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / bs, offset = slot % bs;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t tile = (block * KVH + h) * bs * D;
        const T* k_row = k + t * sh.k_stride + h * D;
        const T* v_row = v + t * sh.v_stride + h * D;
        for (int64_t d = 0; d < D; ++d) k_cache[tile + d * bs + offset] = k_row[d];
        std::copy(v_row, v_row + D, v_cache + tile + offset * D);
      }
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
  const Cascade cascade = plan_cascade(sh, qsl, lens, table, num_reqs);
  Plan plan = plan_items(sh, qsl, lens, num_reqs, cascade);
  const int64_t num_blocks = kv_cache.size(1);
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + num_blocks * sh.num_kv_heads * sh.block_size * sh.head_dim;
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  std::vector<float> partial_acc(plan.num_partials * kQueryTile * sh.group * sh.head_dim);
  std::vector<float> partial_ml(plan.num_partials * kQueryTile * sh.group * 2);
  const int64_t prefix_rows = cascade.num_members * sh.num_kv_heads * sh.group;
  std::vector<float> prefix_acc(prefix_rows * sh.head_dim);
  std::vector<float> prefix_ml(prefix_rows * 2);
  if (!cascade.prefixes.empty()) {  // the shared prefixes first: their members start from them
    struct PrefixItem {
      int64_t prefix, kv_head, begin, end;
    };
    std::vector<PrefixItem> prefix_items;
    for (int64_t p = 0; p < static_cast<int64_t>(cascade.prefixes.size()); ++p) {
      const int64_t members = static_cast<int64_t>(cascade.prefixes[p].requests.size());
      for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
        for (int64_t i = 0; i < members; i += kCascadeChunk) {
          prefix_items.push_back({p, h, i, std::min(members, i + kCascadeChunk)});
        }
      }
    }
    const int64_t count = static_cast<int64_t>(prefix_items.size());
    std::atomic<int64_t> next_prefix{0};
    OCTAVO_CPU_NAMESPACE::parallel_workers(count, [&] {
      Scratch scratch;
      for (int64_t i = next_prefix++; i < count; i = next_prefix++) {
        const PrefixItem& item = prefix_items[i];
        run_prefix<T>(cascade.prefixes[item.prefix], item.kv_head, item.begin, item.end, sh, q,
                      k_cache, v_cache, table, qsl, prefix_acc.data(), prefix_ml.data(),
                      scratch);
      }
    });
  }
  // Items differ in cost (a long prompt's last tiles see its whole context, its first almost
  // none): the threads claim them one at a time, costliest first, so none waits on another.
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  std::vector<int64_t> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return item_cost(plan.items[a]) > item_cost(plan.items[b]);
  });
  std::atomic<int64_t> next{0};
  OCTAVO_CPU_NAMESPACE::parallel_workers(num_items, [&] {
    Scratch scratch;
    for (int64_t i = next++; i < num_items; i = next++) {
      run_item<T>(plan.items[order[i]], sh, q, o, k_cache, v_cache, table, qsl, lens,
                  partial_acc.data(), partial_ml.data(), prefix_acc.data(), prefix_ml.data(),
                  scratch);
    }
  });
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  OCTAVO_CPU_NAMESPACE::parallel_chunks(num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      merge_items<T>(plan.items, plan.groups[g].first, plan.groups[g].second, sh, o, qsl,
                     partial_acc.data(), partial_ml.data());
    }
  });
}

// out[T, H, D] = attention of query[T, H, D] over each request's context, after writing the
// step's key/value[T, KVH, D] into kv_cache through slot_mapping (-1 skips a token).
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                     const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                     int64_t num_tokens) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [T, H, D]");
  TORCH_CHECK(kv_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention needs a contiguous kv_cache and out");
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "query, key and value must be [T, heads, D] with contiguous token rows");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && slot_mapping.scalar_type() == at::kLong,
              "block_table, query_start_loc and seq_lens must be int32, slot_mapping int64");
  TORCH_CHECK(block_table.is_contiguous() && query_start_loc.is_contiguous() &&
                  seq_lens.is_contiguous() && slot_mapping.is_contiguous(),
              "the metadata tensors must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  key.scalar_type() == kv_cache.scalar_type(),
              "query, key, value and kv_cache must share a dtype");
  Shape sh;
  sh.num_heads = query.size(1);
  sh.num_kv_heads = kv_cache.size(2);
  TORCH_CHECK(sh.num_heads % sh.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.block_size = kv_cache.size(3);
  sh.head_dim = kv_cache.size(4);
  sh.max_blocks = block_table.size(1);
  sh.window = sliding_window;
  sh.scale = static_cast<float>(scale);
  sh.q_stride = query.stride(0);
  sh.k_stride = key.stride(0);
  sh.v_stride = value.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention",
                                  [&] {
                                    write_kv<scalar_t>(key, value, kv_cache, slot_mapping, sh,
                                                       num_tokens);
                                    attend<scalar_t>(out, query, kv_cache, block_table,
                                                     query_start_loc, seq_lens, sh);
                                  });
}

}  // namespace

TORCH_LIBRARY(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor(b!) "
      "kv_cache, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
      "Tensor seq_lens, float scale, int sliding_window, SymInt num_tokens) "
      "-> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}

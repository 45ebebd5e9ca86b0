// Linear layers in float32: y[M, N] = x[M, K] @ W[N, K]^T over W packed once, at load. W is
// stored in float32, or in bfloat16 for products that need not be exact (a draft head's: its
// drafts never reach the output), widened exactly in registers: half the bytes to stream, the
// same float32 sums.
//
// The packed weight is [P, K, NR]: panel p holds output columns [p * NR, p * NR + NR) (the last
// one zero-padded), column-interleaved per k, so a panel streams through memory once, in order.
// NR is two vector registers (16 columns on AVX2, 32 on AVX-512).
//
// Every output element is one chain of fused multiply-adds over k = 0, 1, ..., K - 1, starting
// from zero, whatever the row count and however rows and panels are tiled and split among
// threads: a row's result does not depend on the other rows of the batch (batch invariance).
//
// Decode steps have few rows and are bound by streaming the weights from memory; prefill has
// many rows and is bound by arithmetic. Tiles: up to kRowTile rows against one panel (the panel
// stays in L1 while the rows pass over it), and for the last few rows (or a 1-row decode) fewer
// rows against several panels, so there are always about a dozen independent FMA chains for the
// two FMA units to overlap. With AVX-512's 32 registers a batch of up to kFewRowsMax (12) rows
// is one few-row tile (each panel streams from memory once, where whole row tiles and then the
// rows left over would stream the weight twice), and 2-6 rows take 2-4 panels at a time.
// Threads split the work by panel groups (each thread streams its own part of the weight) and,
// for many rows, by chunks of rows.
//
// A tile of two or more rows spends several FMAs on each cache line of its one to four panel
// streams, and the hardware prefetcher then keeps too few lines in flight to hide the latency
// of the last-level cache. So such tiles prefetch the next tile's panels as they go (the line
// at the same k; a whole-row tile, the next panel while its first rows pass). One thread, one
// pass over the demo model's 17 layers (16 MB, from L3) on a Zen 3: 2-3 rows x1.1-1.3 faster,
// 4-6 rows x1.4-1.8 (over runs on a noisy host), 8-32 rows x1.1-1.4; 1 row (no prefetch) and,
// on two threads, 64 or more rows about the same. Weights that stream from DRAM gain little
// (BENCHMARKS.md, issue 16 eighth part). On an Intel Xeon with AVX-512 (family 6 model 207)
// the prefetch of a tile of two to four panels' next panels costs instead (2-3 rows 25% slower
// than without), while a one-panel tile still gains: the AVX-512 build prefetches in one-panel
// tiles only (BENCHMARKS.md, issue 18 eighteenth part). The AVX2 build keeps the Zen 3 tuning.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "work_sharing.h"

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

namespace {

// Explicit intrinsics (not at::vec's wrapper): GCC keeps an array of __m256 / __m512 in
// registers once its loops are unrolled, but not an array of wrapper objects.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
constexpr int64_t kLanes = 16;
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg broadcast(float x) { return _mm512_set1_ps(x); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
// kLanes bfloat16 values widened to float32 exactly (a bfloat16 is a float's top 16 bits).
inline Reg load(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#else
using Reg = __m256;
constexpr int64_t kLanes = 8;
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg broadcast(float x) { return _mm256_set1_ps(x); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg load(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

constexpr int64_t kPanel = 2 * kLanes;  // NR: output columns per panel
constexpr int kRowTile = 6;             // 12 accumulators + 2 weight registers + 1 broadcast
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kFewRowsMax = 12;     // 24 accumulators + 2 weight registers + 1 broadcast
constexpr bool kPrefetchWideTiles = false;
// Panels per few-row tile of `rows` rows: 8-24 accumulators (1-3 rows x 4 panels, 4-6 x 2,
// 7-12 x 1) and 2-8 weight registers (3 rows x 4 panels hold one value more than the registers,
// and still beat 3 panels, whose groups of 4 leave a one-panel tile behind).
constexpr int64_t panels_for(int64_t rows) { return rows <= 3 ? 4 : rows <= 6 ? 2 : 1; }
#else
constexpr int64_t kFewRowsMax = kRowTile - 1;  // 16 registers: more rows make whole row tiles
constexpr bool kPrefetchWideTiles = true;
// Panels per few-row tile of `rows` rows: about a dozen accumulators in all.
constexpr int64_t panels_for(int64_t rows) {
  return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1;
}
#endif
constexpr int64_t kGroupPanels = 4;     // panels per work item
constexpr int64_t kChunkRows = 96;      // about as many rows per work item (they stay in L2)
constexpr int64_t kLineBytes = 64;      // a cache line

// Ask for the cache lines of the panel row at `w` (kPanel weights) to be brought in ahead of use.
template <typename W>
inline void prefetch_panel_row(const W* w) {
  for (int64_t c = 0; c < kPanel * static_cast<int64_t>(sizeof(W)); c += kLineBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + c, _MM_HINT_T1);
  }
}

// R rows of x against NP consecutive panels at w; y gets the first `columns` of the tile's
// NP * kPanel outputs (fewer at the weight's last panel). With two or more rows (and on
// AVX-512 one panel), the `next_panels` panels at `next` (the next tile's) are prefetched on
// the way.
template <int R, int NP, typename W>
inline void tile(const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t columns,
                 const W* next, int64_t next_panels) {
  Reg acc[R][NP][2];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = broadcast(0.f);
  }
  const int64_t panel_stride = K * kPanel;
  constexpr bool prefetch = R > 1 && (NP == 1 || kPrefetchWideTiles);
  for (int64_t k = 0; k < K; ++k) {
    Reg lo[NP], hi[NP];
    for (int p = 0; p < NP; ++p) {
      lo[p] = load(w + p * panel_stride + k * kPanel);
      hi[p] = load(w + p * panel_stride + k * kPanel + kLanes);
    }
    for (int64_t p = 0; prefetch && p < next_panels; ++p) {
      prefetch_panel_row(next + p * panel_stride + k * kPanel);
    }
    for (int r = 0; r < R; ++r) {
      const Reg xv = broadcast(x[r * K + k]);
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = fma(xv, lo[p], acc[r][p][0]);
        acc[r][p][1] = fma(xv, hi[p], acc[r][p][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) {
      float* dst = y + r * N + p * kPanel;
      const int64_t left = columns - p * kPanel;
      if (left >= kPanel) {
        store(dst, acc[r][p][0]);
        store(dst + kLanes, acc[r][p][1]);
      } else if (left > 0) {
        float buffer[kPanel];
        store(buffer, acc[r][p][0]);
        store(buffer + kLanes, acc[r][p][1]);
        std::copy(buffer, buffer + left, dst);
      }
    }
  }
}

// kRowTile rows of x packed as xt[K][kRowTile] (the broadcasts read one stream) against one
// panel, prefetching the panel at `next` on the way unless it is null.
template <typename W>
inline void full_tile(const float* xt, int64_t K, const W* w, float* y, int64_t N,
                      int64_t columns, const W* next) {
  Reg acc[kRowTile][2];
  for (int r = 0; r < kRowTile; ++r) acc[r][0] = acc[r][1] = broadcast(0.f);
  for (int64_t k = 0; k < K; ++k) {
    const Reg lo = load(w + k * kPanel), hi = load(w + k * kPanel + kLanes);
    if (next != nullptr) prefetch_panel_row(next + k * kPanel);
    for (int r = 0; r < kRowTile; ++r) {
      const Reg xv = broadcast(xt[k * kRowTile + r]);
      acc[r][0] = fma(xv, lo, acc[r][0]);
      acc[r][1] = fma(xv, hi, acc[r][1]);
    }
  }
  for (int r = 0; r < kRowTile; ++r) {
    float* dst = y + r * N;
    if (columns >= kPanel) {
      store(dst, acc[r][0]);
      store(dst + kLanes, acc[r][1]);
    } else {
      float buffer[kPanel];
      store(buffer, acc[r][0]);
      store(buffer + kLanes, acc[r][1]);
      std::copy(buffer, buffer + columns, dst);
    }
  }
}

// `rows` (at most kFewRowsMax) rows against `np` panels, in tiles of panels_for(rows) panels; the
// weight has `panels_after` more panels after them (a tile's prefetch may reach into those).
template <typename W>
void few_rows(int64_t rows, const float* x, int64_t K, const W* w, int64_t np, float* y,
              int64_t N, int64_t columns, int64_t panels_after) {
  const int64_t step = panels_for(rows);
  for (int64_t p = 0; p < np; p += step) {
    const int64_t n = std::min(step, np - p);
    const W* wp = w + p * K * kPanel;
    const W* next = wp + n * K * kPanel;
    const int64_t next_panels = std::min(n, np - p - n + panels_after);
    float* yp = y + p * kPanel;
    const int64_t c = columns - p * kPanel;
#define OCTAVO_TILE(R, NP) tile<R, NP, W>(x, K, wp, yp, N, c, next, next_panels)
    switch (rows * 8 + n) {
      case 1 * 8 + 4: OCTAVO_TILE(1, 4); break;
      case 1 * 8 + 3: OCTAVO_TILE(1, 3); break;
      case 1 * 8 + 2: OCTAVO_TILE(1, 2); break;
      case 1 * 8 + 1: OCTAVO_TILE(1, 1); break;
      case 2 * 8 + 3: OCTAVO_TILE(2, 3); break;
      case 2 * 8 + 2: OCTAVO_TILE(2, 2); break;
      case 2 * 8 + 1: OCTAVO_TILE(2, 1); break;
      case 3 * 8 + 2: OCTAVO_TILE(3, 2); break;
      case 3 * 8 + 1: OCTAVO_TILE(3, 1); break;
      case 4 * 8 + 1: OCTAVO_TILE(4, 1); break;
      case 5 * 8 + 1: OCTAVO_TILE(5, 1); break;
#if defined(CPU_CAPABILITY_AVX512)
      case 2 * 8 + 4: OCTAVO_TILE(2, 4); break;
      case 3 * 8 + 4: OCTAVO_TILE(3, 4); break;
      case 3 * 8 + 3: OCTAVO_TILE(3, 3); break;
      case 4 * 8 + 2: OCTAVO_TILE(4, 2); break;
      case 5 * 8 + 2: OCTAVO_TILE(5, 2); break;
      case 6 * 8 + 2: OCTAVO_TILE(6, 2); break;
      case 6 * 8 + 1: OCTAVO_TILE(6, 1); break;
      case 7 * 8 + 1: OCTAVO_TILE(7, 1); break;
      case 8 * 8 + 1: OCTAVO_TILE(8, 1); break;
      case 9 * 8 + 1: OCTAVO_TILE(9, 1); break;
      case 10 * 8 + 1: OCTAVO_TILE(10, 1); break;
      case 11 * 8 + 1: OCTAVO_TILE(11, 1); break;
      case 12 * 8 + 1: OCTAVO_TILE(12, 1); break;
#endif
      default: TORCH_CHECK(false, "gemm: no tile for ", rows, " rows x ", n, " panels");
    }
#undef OCTAVO_TILE
  }
}

template <typename W>
void pack_panels(const W* src, W* dst, int64_t N, int64_t K, int64_t P) {
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const W* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = row[k];
      }
    }
  });
}

// packed[P, K, kPanel] from weight[N, K] (any floating dtype), stored as `stored`: float32
// (the weight widened), or bfloat16 (rounded to nearest even: a draft head's weights, whose
// products need not be exact and stream half the bytes).
at::Tensor pack_weight(const at::Tensor& weight, at::ScalarType stored) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel;
  const at::Tensor w = weight.to(stored).contiguous();
  at::Tensor packed = at::zeros({P, K, kPanel}, w.options());
  if (stored == at::kBFloat16) {
    pack_panels(w.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), N, K, P);
  } else {
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), N, K, P);
  }
  return packed;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) { return pack_weight(weight, at::kFloat); }

at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  return pack_weight(weight, at::kBFloat16);
}

// out[M, N] = x[M, K] @ W^T over W packed as `wp` (float32 or bfloat16 weights, float32 sums).
template <typename W>
void packed_product(const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t N,
                    int64_t P) {
  // Rows in chunks of about kChunkRows (equal ones, whole row tiles), panels in groups; the
  // threads claim (chunk, group) items in turn, so an uneven split costs at most one item.
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t groups = (P + kGroupPanels - 1) / kGroupPanels;
  const int64_t row_chunks = (M + chunk_rows - 1) / chunk_rows;
  const int64_t num_items = row_chunks * groups;
  // Items in turn stream the larger operand once: a weight larger than the rows (an LM head
  // over a decode batch) a panel group at a time, every row chunk against it before the next
  // (chunk after chunk, each chunk would read the whole weight from memory again); otherwise
  // the rows a chunk at a time, against every panel group.
  const bool weight_major = P * kPanel > M;
  // The rows of each whole row tile, packed once as [K][kRowTile], so that a tile's broadcasts
  // read one stream instead of kRowTile rows.
  // Up to kFewRowsMax rows are one few-row tile, with no whole row tiles.
  const bool few_only = M <= kFewRowsMax;
  const int64_t tiles = few_only ? 0 : M / kRowTile;
  // The calling thread's buffer, kept between calls (no page faults per call); the workers use
  // it through this pointer (each thread has its own thread_local).
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < tiles * kRowTile * K) {
    buffer.resize(tiles * kRowTile * K);
  }
  float* xt = buffer.data();
  OCTAVO_CPU_NAMESPACE::parallel_chunks(tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = xt + t * kRowTile * K;
      for (int r = 0; r < kRowTile; ++r) {
        const float* src = xp + (t * kRowTile + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * kRowTile + r] = src[k];
      }
    }
  });
  std::atomic<int64_t> next{0};
  OCTAVO_CPU_NAMESPACE::parallel_workers(num_items, [&] {
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t chunk = weight_major ? item % row_chunks : item / groups;
      const int64_t group = weight_major ? item / row_chunks : item % groups;
      const int64_t m0 = chunk * chunk_rows, m1 = std::min(M, m0 + chunk_rows);
      const int64_t p0 = group * kGroupPanels, np = std::min(kGroupPanels, P - p0);
      const int64_t full = few_only ? m0 : m0 + (m1 - m0) / kRowTile * kRowTile;
      for (int64_t p = p0; p < p0 + np; ++p) {  // each panel stays in L1 across the row tiles
        for (int64_t m = m0; m < full; m += kRowTile) {
          const W* next = m == m0 && p + 1 < P ? wp + (p + 1) * K * kPanel : nullptr;
          full_tile(xt + m * K, K, wp + p * K * kPanel, yp + m * N + p * kPanel, N,
                    N - p * kPanel, next);
        }
      }
      if (full < m1) {
        few_rows(m1 - full, xp + full * K, K, wp + p0 * K * kPanel, np,
                 yp + full * N + p0 * kPanel, N, N - p0 * kPanel, P - p0 - np);
      }
    }
  });
}

// out[M, N] = x[M, K] @ weight^T, weight given packed (pack_linear_weight or, for bfloat16
// weights, pack_linear_weight_bf16).
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "linear: x and out must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "linear: float32 x and out, a float32 or bfloat16 packed weight");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "linear: contiguous x, out and packed weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel,
              "linear: the weight was packed by another build (panel width ", packed.size(2),
              ", this one ", kPanel, ")");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && out.size(0) == M && (N + kPanel - 1) / kPanel == P,
              "linear: x [", M, ", ", K, "], out [", M, ", ", N, "] and the packed weight ",
              packed.sizes(), " do not match");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16) {
    packed_product(xp, packed.data_ptr<at::BFloat16>(), yp, M, K, N, P);
  } else {
    packed_product(xp, packed.data_ptr<float>(), yp, M, K, N, P);
  }
}

// The kernels' work pool yields between jobs (see WorkPool::set_yield_between_jobs): on from the
// first GEMM that runs on another pool (oneDNN's, on OpenMP's threads); returns the previous
// setting.
bool set_work_pool_yield(bool on) {
  return OCTAVO_CPU_NAMESPACE::work_pool().set_yield_between_jobs(on);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def("set_work_pool_yield(bool on) -> bool");
  m.impl("set_work_pool_yield", &set_work_pool_yield);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.impl("pack_linear_weight_bf16", c10::DispatchKey::CPU, &pack_linear_weight_bf16);
  m.impl("linear", c10::DispatchKey::CPU, &linear);
}

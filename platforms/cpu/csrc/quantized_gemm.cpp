// Weight-only quantized linear layers: y[M, N] = x[M, K] @ W[N, K]^T, W kept in blocks of 32
// values with a scale each (GGUF's Q8_0, Q4_0, Q4_1; Q4_K repacked as Q4_1 at load) or as
// per-output-channel int8, never widened in memory.
//
// Panels. The packed weight (made by octavo_cpu/quantized_gemm.py) is [N, row_bytes] uint8:
// the same bytes a row as GGUF's blocks, interleaved in panels of 16 output rows (the last panel
// holds N % 16 rows when 16 does not divide N). A panel is a sequence of slabs, each slab a few
// bytes of every row of the panel in row order, so one vector load takes the same k values of
// 16 rows and the 16 sums of a panel stay in the lanes of one register (no horizontal sums):
//   Q8_0  per block: 16 slabs of 2 int8 (k = 2p, 2p + 1), then a slab of fp16 d    w = d * q
//   Q4_0  per block: 8 slabs of 2 bytes, then d; byte h (0, 1) of slab c holds k = 4c + h in
//         its low nibble and k = 4c + 2 + h in its high one                         w = d * (q - 8)
//   Q4_1  as Q4_0, then a slab of fp16 m                                            w = d * q + m
//   int8  K / 2 slabs of 2 int8, then a slab of the rows' float32 scales s          w = s * q
//
// Activations. Each block of 32 values of x is rounded to int16 with a float scale (its largest
// magnitude is 32767): 15 bits, where llama.cpp's integer dot products round to 8 (that moved
// SmolLM2-135M's products by ~1% and its greedy text off the dequantized model's on 10 of 16
// chat prompts; int16 moves them by ~1e-5). A block's 16 row sums are then exact int32 dot
// products of int16 pairs (vpdpwssd with AVX512-VNNI, vpmaddwd + vpaddd on AVX2; |sum| <
// 32 * 127 * 32767 < 2^31), widened once and scaled by d times x's block scale. Q4_0's -8 and
// Q4_1's m multiply the block's sum of rounded x (-8 exactly, in the int32 sum).
//
// Every output element is one fixed sequence over the blocks, whatever the batch, its tiling or
// its threads (a block's integer sum is exact in any order): a row's result does not depend on
// the rows around it. Threads split the panels (each streams its own); tiles are up to 4 rows
// of x against one or two panels (one widening of a weight slab serves every row of the tile),
// within groups of 64 rows of x whose int16 values stay in L2 while a chunk of panels passes.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

namespace {

enum QuantType : int64_t { kQ8_0 = 0, kQ4_0 = 1, kInt8 = 2, kQ4_1 = 3 };
constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;      // output rows interleaved in a panel
constexpr int kMaxRows = 4;         // x rows per tile
constexpr int64_t kRowGroup = 64;   // x rows whose int16 values stay in L2 while a chunk passes
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of a panel's reads its lines are asked for

int64_t packed_row_bytes(int64_t type, int64_t K) {
  const int64_t nb = K / kBlock;
  switch (type) {
    case kQ8_0: return nb * 34;
    case kQ4_0: return nb * 18;
    case kQ4_1: return nb * 20;
    case kInt8: return K + 4;
    default: TORCH_CHECK(false, "quantized_linear: unknown quant_type ", type);
  }
  return 0;
}

// Bytes of a block's quants in a full panel, and of the whole block (quants and fp16 slabs).
constexpr int64_t panel_quant_bytes(int64_t type) {
  return type == kQ8_0 || type == kInt8 ? 32 * kPanel : 16 * kPanel;
}
constexpr int64_t panel_block_bytes(int64_t type) {
  return panel_quant_bytes(type) + (type == kQ4_1 ? 4 : type == kInt8 ? 0 : 2) * kPanel;
}

// ---- 16 lanes of int32 or float: one register with AVX-512, two with AVX2.
#if defined(CPU_CAPABILITY_AVX512)
struct I16 {
  __m512i v;
};
struct F16 {
  __m512 v;
};
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 isub1(I16 a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
// 32 int16: each lane's pair (row r's k and k + 1) times x's pair, added to the lane.
inline I16 dot_pairs(I16 acc, I16 w, int32_t x_pair) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(x_pair))};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, _mm512_set1_epi32(x_pair)))};
#endif
}
inline I16 load_q8(const uint8_t* p) {  // 32 int8 -> int16
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void load_q4(const uint8_t* p, I16& low, I16& high) {  // 32 bytes -> 2 x 32 nibbles
  const __m512i bytes =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  low.v = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
  high.v = _mm512_srli_epi16(bytes, 4);
}
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F16 load_halves(const uint8_t* p) {  // 16 fp16
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16 load_floats(const uint8_t* p) {
  return {_mm512_loadu_ps(reinterpret_cast<const float*>(p))};
}
inline F16 fmul1(F16 a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
inline F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 ffma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 ffma1(F16 a, float b, F16 c) {
  return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(b), c.v)};
}
inline void store(float* out, F16 a, int64_t count) {
  if (count == kPanel) {
    _mm512_storeu_ps(out, a.v);
  } else {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1u), a.v);
  }
}
constexpr int kMaxPanels = 2;  // registers for 4 x rows against 2 panels
#else
struct I16 {
  __m256i lo, hi;
};
struct F16 {
  __m256 lo, hi;
};
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 iadd(I16 a, I16 b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
inline I16 isub1(I16 a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline I16 dot_pairs(I16 acc, I16 w, int32_t x_pair) {
  const __m256i x = _mm256_set1_epi32(x_pair);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, x)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, x))};
}
inline I16 load_q8(const uint8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline void load_q4(const uint8_t* p, I16& low, I16& high) {
  const __m256i mask = _mm256_set1_epi16(0x0F);
  const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  low = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask)};
  high = {_mm256_srli_epi16(a, 4), _mm256_srli_epi16(b, 4)};
}
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F16 load_halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline F16 load_floats(const uint8_t* p) {
  const float* f = reinterpret_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
inline F16 fmul1(F16 a, float b) {
  const __m256 v = _mm256_set1_ps(b);
  return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)};
}
inline F16 fmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 ffma(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 ffma1(F16 a, float b, F16 c) {
  const __m256 v = _mm256_set1_ps(b);
  return {_mm256_fmadd_ps(a.lo, v, c.lo), _mm256_fmadd_ps(a.hi, v, c.hi)};
}
inline void store(float* out, F16 a, int64_t count) {
  alignas(32) float lanes[kPanel];
  _mm256_store_ps(lanes, a.lo);
  _mm256_store_ps(lanes + 8, a.hi);
  std::memcpy(out, lanes, count * sizeof(float));
}
constexpr int kMaxPanels = 1;  // 16 registers: one panel's sums for 4 x rows already fill them
#endif

// ---- x rounded to int16 per block of 32.
struct Activations {
  std::vector<int16_t> values;  // [M, K]
  std::vector<float> scales;    // [M, nb]: x ~= values * scale
  std::vector<int32_t> sums;    // [M, nb]: each block's sum of values
  int64_t K = 0, nb = 0;

  int32_t pair(int64_t m, int64_t k) const {  // values k and k + 1 of row m as one int32
    int32_t v;
    std::memcpy(&v, values.data() + m * K + k, sizeof(v));
    return v;
  }
};

// Block b of row m: the largest magnitude maps to 32767, each value rounds to nearest (even).
void round_block(const float* x, int16_t* values, float* scale, int32_t* sum) {
  float largest = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
  *scale = largest / 32767.0f;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 f = _mm512_set1_ps(inverse);
  const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), f));
  const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), f));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values), _mm512_cvtsepi32_epi16(a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + 16), _mm512_cvtsepi32_epi16(b));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
#else
  int32_t total = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[k] * inverse));
    values[k] = static_cast<int16_t>(std::clamp(v, -32767, 32767));
    total += values[k];
  }
  *sum = total;
#endif
}

void round_activations(const float* x, int64_t M, int64_t K, Activations& a) {
  a.K = K;
  a.nb = K / kBlock;
  a.values.resize(M * K);
  a.scales.resize(M * a.nb);
  a.sums.resize(M * a.nb);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(M * a.nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      round_block(x + i * kBlock, a.values.data() + i * kBlock, &a.scales[i], &a.sums[i]);
    }
  });
}

// out[r * N + 16 q + lane] for R rows of x (from row m) against P consecutive full-layout panels
// at w (panel_bytes apart); `count` of each panel's 16 outputs are stored.
template <int64_t Type, int R, int P>
void panel_tile(const uint8_t* w, int64_t panel_bytes, const Activations& a, int64_t m,
                float* out, int64_t N, int64_t count) {
  constexpr int64_t kQuant = panel_quant_bytes(Type), kBlockBytes = panel_block_bytes(Type);
  constexpr int C = R == 1 ? 2 : 1;  // int32 sums a row keeps apart (latency of dot_pairs)
  const int64_t nb = a.nb;
  F16 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q] = fzero();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[P];
    for (int q = 0; q < P; ++q) {
      blk[q] = w + q * panel_bytes + b * kBlockBytes;
      // Each panel streams once: ask for every line kPrefetchBytes ahead (the hardware
      // prefetcher loses the stream at each chunk a thread claims).
      for (int64_t line = 0; line < kBlockBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(blk[q] + kPrefetchBytes + line), _MM_HINT_T0);
      }
    }
    I16 sums[R][P][C];
    for (int r = 0; r < R; ++r) {
      for (int q = 0; q < P; ++q) {
        for (int c = 0; c < C; ++c) sums[r][q][c] = izero();
      }
    }
    const int64_t k0 = b * kBlock;
    if constexpr (Type == kQ8_0 || Type == kInt8) {
      for (int p = 0; p < 16; ++p) {
        I16 wv[P];
        for (int q = 0; q < P; ++q) wv[q] = load_q8(blk[q] + 32 * p);
        for (int r = 0; r < R; ++r) {
          const int32_t xp = a.pair(m + r, k0 + 2 * p);
          for (int q = 0; q < P; ++q) sums[r][q][p % C] = dot_pairs(sums[r][q][p % C], wv[q], xp);
        }
      }
    } else {
      for (int s = 0; s < 8; ++s) {
        I16 low[P], high[P];
        for (int q = 0; q < P; ++q) load_q4(blk[q] + 32 * s, low[q], high[q]);
        for (int r = 0; r < R; ++r) {
          const int32_t x_low = a.pair(m + r, k0 + 4 * s), x_high = a.pair(m + r, k0 + 4 * s + 2);
          for (int q = 0; q < P; ++q) {
            sums[r][q][0] = dot_pairs(sums[r][q][0], low[q], x_low);
            sums[r][q][C - 1] = dot_pairs(sums[r][q][C - 1], high[q], x_high);
          }
        }
      }
    }
    for (int q = 0; q < P; ++q) {
      F16 d, minimum;
      if constexpr (Type != kInt8) d = load_halves(blk[q] + kQuant);
      if constexpr (Type == kQ4_1) minimum = load_halves(blk[q] + kQuant + 2 * kPanel);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * nb + b;
        const float dx = a.scales[i];
        I16 total = sums[r][q][0];
        if constexpr (C == 2) total = iadd(total, sums[r][q][1]);
        if constexpr (Type == kQ4_0) total = isub1(total, 8 * a.sums[i]);
        if constexpr (Type == kInt8) {
          acc[r][q] = ffma1(to_float(total), dx, acc[r][q]);
        } else {
          acc[r][q] = ffma(to_float(total), fmul1(d, dx), acc[r][q]);
        }
        if constexpr (Type == kQ4_1) {
          acc[r][q] = ffma1(minimum, static_cast<float>(a.sums[i]) * dx, acc[r][q]);
        }
      }
    }
  }
  for (int q = 0; q < P; ++q) {
    F16 row_scale;
    if constexpr (Type == kInt8) row_scale = load_floats(w + q * panel_bytes + nb * kQuant);
    for (int r = 0; r < R; ++r) {
      const F16 y = Type == kInt8 ? fmul(acc[r][q], row_scale) : acc[r][q];
      store(out + r * N + q * kPanel, y, count);
    }
  }
}

template <int64_t Type, int P>
void rows_against(const uint8_t* w, int64_t panel_bytes, const Activations& a, int64_t m,
                  int64_t rows, float* out, int64_t N, int64_t count) {
  switch (rows) {
    case 4: return panel_tile<Type, 4, P>(w, panel_bytes, a, m, out, N, count);
    case 3: return panel_tile<Type, 3, P>(w, panel_bytes, a, m, out, N, count);
    case 2: return panel_tile<Type, 2, P>(w, panel_bytes, a, m, out, N, count);
    default: return panel_tile<Type, 1, P>(w, panel_bytes, a, m, out, N, count);
  }
}

// The last panel's `rows` (< 16) rows in the full layout, the missing rows zero: every slab of
// 2 bytes a row (int8's last, of 4) spread to 16 rows.
void widen_tail_panel(const uint8_t* tail, int64_t rows, int64_t type, int64_t K,
                      std::vector<uint8_t>& full) {
  const int64_t row_bytes = packed_row_bytes(type, K);
  full.assign(kPanel * row_bytes, 0);
  const int64_t pairs = type == kInt8 ? K / 2 : row_bytes / 2;
  for (int64_t s = 0; s < pairs; ++s) {
    std::memcpy(full.data() + s * 2 * kPanel, tail + s * 2 * rows, 2 * rows);
  }
  if (type == kInt8) {
    std::memcpy(full.data() + pairs * 2 * kPanel, tail + pairs * 2 * rows, 4 * rows);
  }
}

template <int64_t Type>
void product(const uint8_t* packed, const float* x, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t panel_bytes = kPanel * packed_row_bytes(Type, K);
  thread_local Activations activations;  // the caller's, kept between calls
  round_activations(x, M, K, activations);
  const Activations& a = activations;
  const int64_t panels = (N + kPanel - 1) / kPanel, tail_rows = N % kPanel;
  // Chunks of at least ~32 KB of weight (fewer panels the more x rows each serves): a decode
  // step's few rows still split a small projection between the threads.
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t grain = std::max<int64_t>(1, (32768 / panel_bytes) / tiles);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(panels, grain, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<uint8_t> tail_panel;
    for (int64_t g = 0; g < M; g += kRowGroup) {
      const int64_t g1 = std::min(M, g + kRowGroup);
      for (int64_t n = n0; n < n1;) {
        const bool tail = tail_rows > 0 && n == panels - 1;
        const uint8_t* w = packed + n * panel_bytes;
        if (tail) {
          widen_tail_panel(w, tail_rows, Type, K, tail_panel);
          w = tail_panel.data();
        }
        // Two panels a tile where registers allow and three or more x rows share them.
        const int64_t p = !tail && n + 2 <= n1 - (tail_rows > 0 && n1 == panels) && g1 - g >= 3
                              ? kMaxPanels
                              : 1;
        const int64_t count = tail ? tail_rows : kPanel;
        for (int64_t m = g; m < g1; m += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, g1 - m);
          float* out = y + m * N + n * kPanel;
          if (p == 2) {
            rows_against<Type, kMaxPanels>(w, panel_bytes, a, m, rows, out, N, count);
          } else {
            rows_against<Type, 1>(w, panel_bytes, a, m, rows, out, N, count);
          }
        }
        n += p;
      }
    }
  });
}

// out [M, N] = x [M, K] @ W^T for a weight packed as the header says.
void quantized_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                      int64_t quant_type, int64_t in_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kByte,
              "quantized_linear: float32 x and out, a uint8 packed weight");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "quantized_linear: contiguous x, out and packed weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K == in_features && K % kBlock == 0,
              "quantized_linear: x has ", K, " columns; the weight takes ", in_features,
              " (a multiple of ", kBlock, ")");
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == packed_row_bytes(quant_type, K),
              "quantized_linear: the packed weight ", packed.sizes(), " is not ", N, " rows of ",
              packed_row_bytes(quant_type, K), " bytes for quant_type ", quant_type);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "quantized_linear: out must be [", M, ", ",
              N, "]");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  switch (quant_type) {
    case kQ8_0: return product<kQ8_0>(w, xp, y, M, K, N);
    case kQ4_0: return product<kQ4_0>(w, xp, y, M, K, N);
    case kQ4_1: return product<kQ4_1>(w, xp, y, M, K, N);
    case kInt8: return product<kInt8>(w, xp, y, M, K, N);
    default: TORCH_CHECK(false, "quantized_linear: unknown quant_type ", quant_type);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "quantized_linear(Tensor(a!) out, Tensor x, Tensor packed, int quant_type, "
      "int in_features) -> ()");
  m.impl("quantized_linear", c10::DispatchKey::CPU, &quantized_linear);
}

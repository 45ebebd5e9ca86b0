// Weight-only quantized linear layers: y[M, N] = x[M, K] @ W[N, K]^T, W kept in blocks of 32
// values with a scale each (GGUF's Q8_0, Q4_0, Q4_1; Q4_K repacked as Q4_1 at load) or as
// per-output-channel int8, never widened in memory.
//
// The packed weight (made by octavo_cpu/quantized_gemm.py) is [N, row_bytes] uint8, each row its
// blocks' quants first and their scales after:
//   Q8_0  nb * 32 int8, then nb fp16 scales d                    w = d * q
//   Q4_0  nb * 16 bytes, then nb fp16 d                           w = d * (q - 8)
//   Q4_1  nb * 16 bytes, then nb fp16 d, then nb fp16 m           w = d * q + m
//   int8  K int8, then the row's float32 scale s                  w = s * q
// where byte j of a 4-bit block holds value j in its low nibble and value j + 16 in its high one.
//
// The activations stay float32: each weight block is widened to floats in registers (once for
// up to 4 rows of x) and multiplied with fused multiply-adds, its sum scaled once by the block's
// d. (Rounding the activations to int8 per block of 32, as llama.cpp does for its integer dot
// products, moved each product of SmolLM2-135M by ~1% and its greedy text off the dequantized
// model's on 10 of 16 chat prompts; decoding is bound by streaming the weight either way.) Q4_1
// multiplies q - 8 and adds (m + 8 d) times the block's sum of x.
//
// Every output element is one fixed sequence over the blocks, whatever the batch, its tiling or
// its threads: a row's result does not depend on the rows around it. Threads split the output
// columns (each streams its own rows of the weight); tiles are up to 4 rows of x against 2 weight
// rows (one widening of a weight block serves 4 rows, one load of an x block 2 weight rows; one
// or two x rows take 4 weight rows of 4-bit blocks), within panels of 64 rows of x. Each row's
// fp16 block scales are widened 16 at a time.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "work_sharing.h"

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

namespace {

enum QuantType : int64_t { kQ8_0 = 0, kQ4_0 = 1, kInt8 = 2, kQ4_1 = 3 };
constexpr int64_t kBlock = 32;
constexpr int kMaxRows = 4;        // x rows per weight row in one pass
constexpr int64_t kPanelRows = 64;  // x rows whose int16 values stay in L2 while a chunk passes

int64_t quant_bytes_per_block(int64_t type) { return type == kQ8_0 || type == kInt8 ? 32 : 16; }

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

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

#if defined(CPU_CAPABILITY_AVX512)
using FReg = __m512;  // 16 floats: a block is 2
constexpr int kRegs = 2;
inline FReg fzero() { return _mm512_setzero_ps(); }
inline FReg fload(const float* p) { return _mm512_loadu_ps(p); }
inline FReg fmul(FReg a, FReg b) { return _mm512_mul_ps(a, b); }
inline FReg ffma(FReg a, FReg b, FReg c) { return _mm512_fmadd_ps(a, b, c); }
inline FReg fset1(float v) { return _mm512_set1_ps(v); }
inline float reduce(FReg v) { return _mm512_reduce_add_ps(v); }
// Values 16 i .. 16 i + 15 of a block as floats.
inline FReg widen_q8(const uint8_t* q, int i) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline FReg widen_q4(const uint8_t* q, int i) {  // q - 8
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i nibbles =
      i == 0 ? _mm_and_si128(bytes, mask) : _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m512i values = _mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles), _mm512_set1_epi32(8));
  return _mm512_cvtepi32_ps(values);
}
#else
using FReg = __m256;  // 8 floats: a block is 4
constexpr int kRegs = 4;
inline FReg fzero() { return _mm256_setzero_ps(); }
inline FReg fload(const float* p) { return _mm256_loadu_ps(p); }
inline FReg fmul(FReg a, FReg b) { return _mm256_mul_ps(a, b); }
inline FReg ffma(FReg a, FReg b, FReg c) { return _mm256_fmadd_ps(a, b, c); }
inline FReg fset1(float v) { return _mm256_set1_ps(v); }
inline float reduce(FReg v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline FReg widen_q8(const uint8_t* q, int i) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline FReg widen_q4(const uint8_t* q, int i) {  // q - 8; values 8 i .. 8 i + 7
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (i % 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i nibbles =
      i < 2 ? _mm_and_si128(bytes, mask) : _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256i values = _mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles), _mm256_set1_epi32(8));
  return _mm256_cvtepi32_ps(values);
}
#endif
constexpr int64_t kLanes = kBlock / kRegs;

#if defined(CPU_CAPABILITY_AVX512)
inline FReg fadd_or(FReg a, FReg b) { return _mm512_add_ps(a, b); }
#else
inline FReg fadd_or(FReg a, FReg b) { return _mm256_add_ps(a, b); }
#endif

// Q4_1's minima multiply each block's exact sum of x: xs[m][b].
void block_sums(const float* x, int64_t M, int64_t K, std::vector<float>& xs) {
  const int64_t nb = K / kBlock;
  xs.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    float total = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) total += x[i * kBlock + k];
    xs[i] = total;
  }
}

// Blocks per group whose fp16 scales are widened together (one vector conversion instead of a
// scalar one per block).
constexpr int64_t kScaleGroup = 16;

// The float32 values of `count` (at most kScaleGroup) fp16 scales at `d`.
inline void widen_scales(const uint16_t* d, int64_t count, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
  const __m256i halves = _mm256_maskz_loadu_epi16(mask, d);
  _mm512_storeu_ps(out, _mm512_cvtph_ps(halves));
#else
  for (int64_t i = 0; i < count; ++i) out[i] = half_to_float(d[i]);
#endif
}

// out[r * N + j] for R rows of x against WR consecutive packed weight rows: each weight block
// is widened to floats once for the R rows, each block of x loaded once for the WR rows.
template <int64_t Type, int R, int WR>
void dot_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs, int64_t K,
              float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  const int64_t qb = quant_bytes_per_block(Type);
  FReg acc[R][WR];
  float mins[R][WR];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < WR; ++j) acc[r][j] = fzero(), mins[r][j] = 0.0f;
  }
  alignas(64) float scales[WR][kScaleGroup], minima[WR][kScaleGroup];
  for (int64_t g = 0; g < nb; g += kScaleGroup) {
    const int64_t count = std::min(kScaleGroup, nb - g);
    if (Type != kInt8) {
      for (int j = 0; j < WR; ++j) {
        const uint16_t* d = reinterpret_cast<const uint16_t*>(w + j * row_bytes + nb * qb);
        widen_scales(d + g, count, scales[j]);
        if (Type == kQ4_1) widen_scales(d + nb + g, count, minima[j]);
      }
    }
    for (int64_t b = g; b < g + count; ++b) {
      for (int j = 0; j < WR; ++j) {
        const uint8_t* q = w + j * row_bytes + b * qb;
        // The weight streams from memory once: ask for the lines ~WR rows ahead (the hardware
        // prefetcher loses the stream at each chunk a thread claims).
        _mm_prefetch(reinterpret_cast<const char*>(q + WR * row_bytes), _MM_HINT_T0);
        FReg wv[kRegs];
        for (int i = 0; i < kRegs; ++i) {
          wv[i] = Type == kQ8_0 || Type == kInt8 ? widen_q8(q, i) : widen_q4(q, i);
        }
        const float dw = Type == kInt8 ? 1.0f : scales[j][b - g];
        for (int r = 0; r < R; ++r) {
          const float* xb = x + r * K + b * kBlock;
          FReg block = fmul(wv[0], fload(xb));
          for (int i = 1; i < kRegs; ++i) block = ffma(wv[i], fload(xb + i * kLanes), block);
          acc[r][j] =
              Type == kInt8 ? fadd_or(block, acc[r][j]) : ffma(block, fset1(dw), acc[r][j]);
        }
        if (Type == kQ4_1) {  // w = d (q - 8) + (m + 8 d)
          const float m = minima[j][b - g] + 8.0f * dw;
          for (int r = 0; r < R; ++r) mins[r][j] += m * xs[r * nb + b];
        }
      }
    }
  }
  for (int j = 0; j < WR; ++j) {
    const uint8_t* row = w + j * row_bytes;
    const float row_scale = Type == kInt8 ? *reinterpret_cast<const float*>(row + K) : 1.0f;
    for (int r = 0; r < R; ++r) out[r * N + j] = (reduce(acc[r][j]) + mins[r][j]) * row_scale;
  }
}

template <int64_t Type, int WR>
void rows_against(const uint8_t* w, int64_t row_bytes, const float* x, const float* xs,
                  int64_t rows, int64_t K, float* out, int64_t N) {
  switch (rows) {
    case 4: return dot_rows<Type, 4, WR>(w, row_bytes, x, xs, K, out, N);
    case 3: return dot_rows<Type, 3, WR>(w, row_bytes, x, xs, K, out, N);
    case 2: return dot_rows<Type, 2, WR>(w, row_bytes, x, xs, K, out, N);
    default: return dot_rows<Type, 1, WR>(w, row_bytes, x, xs, K, out, N);
  }
}

template <int64_t Type>
void product(const uint8_t* packed, const float* x, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t row_bytes = packed_row_bytes(Type, K), nb = K / kBlock;
  thread_local std::vector<float> sums;  // the caller's, kept between calls
  if (Type == kQ4_1) block_sums(x, M, K, sums);
  const float* xs = sums.data();
  // Chunks of at least ~32 KB of weight (fewer rows the more x rows each serves): a decode
  // step's few rows still split a small projection between the threads.
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t grain = std::max<int64_t>(2, (32768 / row_bytes) / tiles);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t p = 0; p < M; p += kPanelRows) {
      const int64_t p1 = std::min(M, p + kPanelRows);
      for (int64_t n = n0; n < n1;) {
        const uint8_t* w = packed + n * row_bytes;
        // One or two x rows leave registers for 4 weight rows of 4-bit blocks: each x block
        // loaded once for 4 (faster for Q4_0 and Q4_1 at one x row; Q8_0 and int8 were not).
        constexpr bool kFourBit = Type == kQ4_0 || Type == kQ4_1;
        const int64_t wr = kFourBit && n + 4 <= n1 && p1 - p <= 2 ? 4 : n + 2 <= n1 ? 2 : 1;
        for (int64_t m = p; m < p1; m += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, p1 - m);
          const float* xm = x + m * K;
          const float* xsm = xs + m * nb;
          float* ym = y + m * N + n;
          if (wr == 4) {
            rows_against<Type, 4>(w, row_bytes, xm, xsm, rows, K, ym, N);
          } else if (wr == 2) {
            rows_against<Type, 2>(w, row_bytes, xm, xsm, rows, K, ym, N);
          } else {
            rows_against<Type, 1>(w, row_bytes, xm, xsm, rows, K, ym, N);
          }
        }
        n += wr;
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

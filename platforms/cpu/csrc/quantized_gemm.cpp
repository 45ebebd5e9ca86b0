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
// As llama.cpp does, each call first rounds each block of 32 activations of each row to int16
// values in [-127, 127] with one float scale (amax / 127): a block's dot product is then exact
// integer arithmetic (vpmaddwd: 32 products summed in pairs into 16 int32 lanes), scaled once by
// d_w * d_x into float32 lanes. The rounding moves a product by ~0.5% of its size (the
// conformance suite's budget). Q4_1 multiplies q - 8 (centred, as Q4_0's: the rounding then
// costs what it costs Q4_0, where d * q with its large mean cost twice that) and adds
// (m + 8 d) times the block's exact float sum.
//
// Every output element is one fixed sequence over the blocks, whatever the batch, its tiling or
// its threads: a row's result does not depend on the rows around it. Threads split the output
// columns (each streams its own rows of the weight); tiles are up to 4 rows of x against 2 weight
// rows (one widening of a weight block serves 4 rows, one load of an x block 2 weight rows),
// within panels of 64 rows of x.

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
using IReg = __m512i;  // 32 int16: one block
constexpr int kRegsPerBlock = 1;
inline IReg madd(IReg a, IReg b) { return _mm512_madd_epi16(a, b); }
inline IReg add(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
inline __m512 to_float(IReg v) { return _mm512_cvtepi32_ps(v); }
using FReg = __m512;
inline FReg fzero() { return _mm512_setzero_ps(); }
inline FReg fma_scaled(IReg sums, float scale, FReg acc) {
  return _mm512_fmadd_ps(to_float(sums), _mm512_set1_ps(scale), acc);
}
inline float reduce(FReg v) { return _mm512_reduce_add_ps(v); }
inline IReg load_x(const int16_t* p, int) { return _mm512_loadu_si512(p); }
inline IReg widen_q8(const uint8_t* q, int) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}
inline IReg widen_q4(const uint8_t* q, int, int16_t offset) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  return _mm512_sub_epi16(_mm512_cvtepu8_epi16(both), _mm512_set1_epi16(offset));
}
#else
using IReg = __m256i;  // 16 int16: half a block
constexpr int kRegsPerBlock = 2;
inline IReg madd(IReg a, IReg b) { return _mm256_madd_epi16(a, b); }
inline IReg add(IReg a, IReg b) { return _mm256_add_epi32(a, b); }
using FReg = __m256;
inline FReg fzero() { return _mm256_setzero_ps(); }
inline FReg fma_scaled(IReg sums, float scale, FReg acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
}
inline float reduce(FReg v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline IReg load_x(const int16_t* p, int half) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * half));
}
inline IReg widen_q8(const uint8_t* q, int half) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half)));
}
inline IReg widen_q4(const uint8_t* q, int half, int16_t offset) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i nibbles = half == 0 ? _mm_and_si128(bytes, mask)
                                    : _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_sub_epi16(_mm256_cvtepu8_epi16(nibbles), _mm256_set1_epi16(offset));
}
#endif

// Rows of x as int16 blocks: xq[m][k], the scale dx[m][b] and the exact sum xs[m][b] of each.
struct QuantizedRows {
  std::vector<int16_t> xq;
  std::vector<float> dx, xs;
};

void quantize_block(const float* x, int16_t* q, float* d, float* sum) {
  float amax = 0.0f, total = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    total += x[k];
  }
  const float scale = amax / 127.0f;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) q[k] = static_cast<int16_t>(std::nearbyint(x[k] * inverse));
  *d = scale;
  *sum = total;
}

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& rows) {
  const int64_t nb = K / kBlock;
  rows.xq.resize(M * K);
  rows.dx.resize(M * nb);
  rows.xs.resize(M * nb);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_block(x + i * kBlock, rows.xq.data() + i * kBlock, rows.dx.data() + i,
                     rows.xs.data() + i);
    }
  });
}

// out[r * N + j] for R rows of x against WR consecutive packed weight rows (two chains of
// fused multiply-adds per x row, and each block of x loaded once for both weight rows).
template <int64_t Type, int R, int WR>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  const int64_t qb = quant_bytes_per_block(Type);
  const int16_t* xq = x.xq.data() + m0 * K;
  const float* dx = x.dx.data() + m0 * nb;
  FReg acc[R][WR];
  float mins[R][WR];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < WR; ++j) acc[r][j] = fzero(), mins[r][j] = 0.0f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    IReg sums[R][WR];
    float dw[WR];
    for (int j = 0; j < WR; ++j) {
      const uint8_t* row = w + j * row_bytes;
      const uint16_t* d = reinterpret_cast<const uint16_t*>(row + nb * qb);
      // The weight streams from memory once: ask for the lines ~2 rows ahead (the hardware
      // prefetcher loses the stream at each chunk a thread claims).
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * row_bytes + b * qb), _MM_HINT_T0);
      dw[j] = Type == kInt8 ? 1.0f : half_to_float(d[b]);
      for (int h = 0; h < kRegsPerBlock; ++h) {
        // Q4_1 multiplies q - 8 too: centred, like Q4_0's
        const IReg wv = Type == kQ8_0 || Type == kInt8 ? widen_q8(row + b * qb, h)
                                                       : widen_q4(row + b * qb, h, 8);
        for (int r = 0; r < R; ++r) {
          const IReg p = madd(wv, load_x(xq + r * K + b * kBlock, h));
          sums[r][j] = h == 0 ? p : add(p, sums[r][j]);
        }
      }
      if (Type == kQ4_1) {
        const float m = half_to_float(d[nb + b]) + 8.0f * dw[j];  // w = d (q - 8) + (m + 8 d)
        for (int r = 0; r < R; ++r) mins[r][j] += m * x.xs[(m0 + r) * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < WR; ++j) {
        acc[r][j] = fma_scaled(sums[r][j], dw[j] * dx[r * nb + b], acc[r][j]);
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
void rows_against(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                  int64_t rows, int64_t K, float* out, int64_t N) {
  switch (rows) {
    case 4: return dot_rows<Type, 4, WR>(w, row_bytes, x, m0, K, out, N);
    case 3: return dot_rows<Type, 3, WR>(w, row_bytes, x, m0, K, out, N);
    case 2: return dot_rows<Type, 2, WR>(w, row_bytes, x, m0, K, out, N);
    default: return dot_rows<Type, 1, WR>(w, row_bytes, x, m0, K, out, N);
  }
}

template <int64_t Type>
void product(const uint8_t* packed, const QuantizedRows& x, float* y, int64_t M, int64_t K,
             int64_t N) {
  const int64_t row_bytes = packed_row_bytes(Type, K);
  // Chunks of at least ~32 KB of weight (fewer rows the more x rows each serves): a decode
  // step's few rows still split a small projection between the threads.
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t grain = std::max<int64_t>(2, (32768 / row_bytes) / tiles);
  OCTAVO_CPU_NAMESPACE::parallel_chunks(N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t p = 0; p < M; p += kPanelRows) {
      const int64_t p1 = std::min(M, p + kPanelRows);
      for (int64_t n = n0; n < n1; n += 2) {
        const uint8_t* w = packed + n * row_bytes;
        for (int64_t m = p; m < p1; m += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, p1 - m);
          if (n + 1 < n1) {
            rows_against<Type, 2>(w, row_bytes, x, m, rows, K, y + m * N + n, N);
          } else {
            rows_against<Type, 1>(w, row_bytes, x, m, rows, K, y + m * N + n, N);
          }
        }
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
  thread_local QuantizedRows rows;  // kept between calls: no allocation per call
  quantize_rows(x.data_ptr<float>(), M, K, rows);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  switch (quant_type) {
    case kQ8_0: return product<kQ8_0>(w, rows, y, M, K, N);
    case kQ4_0: return product<kQ4_0>(w, rows, y, M, K, N);
    case kQ4_1: return product<kQ4_1>(w, rows, y, M, K, N);
    case kInt8: return product<kInt8>(w, rows, y, M, K, N);
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

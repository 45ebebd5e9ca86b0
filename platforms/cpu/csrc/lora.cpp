// Batched multi-LoRA products: a step's tokens each read the adapter of their own slot (or none),
// with the tokens grouped by slot once per step (octavo.lora.mapping's segments).
//   shrink: out[t, :R] = x[t] @ A[slot(t)]^T in float32; a row without an adapter is zeros.
//   expand: y[t, offset : offset + N] += buffer[t] @ B[slot(t)]^T, the product summed in float32
//           and added to y's value in float32, rounded once into y's dtype; rows without an
//           adapter and columns outside the window are not touched.
// A [S, R, K] and B [S, N, R] are in the model dtype (float32 or bfloat16), stacked per slot.
//
// An adapter is small (R is 8..64: A and B of one slot stay in L2, mostly L1), so the work is
// arranged per segment: one slot's weights serve all of the segment's tokens, a tile of tokens
// at a time, and threads split a segment's tokens and its output columns (ranks for the shrink),
// never copying the weights per token as an index_select would.
//
// Shrink: each (token, rank) output is a dot product over K, the contiguous axis of both x and
// A. Tiles of up to 4 tokens x 4 ranks (2 x 4 on AVX2's 16 registers) accumulate one vector of
// partial sums per pair over k, then sum its lanes. bfloat16 on AVX-512 multiplies pairs of
// bfloat16 straight from memory (vdpbf16ps: products exact in float32, each add rounded, as an
// FMA's, but subnormal inputs and sums flushed to zero); AVX2 widens them exactly in registers
// and uses FMAs.
//
// Expand: each output is a dot product over R, too short to vectorise along. Instead a work item
// transposes a chunk of B's rows (kColumns output columns, 64 on AVX-512, 32 on AVX2) into a
// thread's scratch [R][kColumns] in float32 (8 x 8 blocks in registers), then runs the segment's
// tokens over it in tiles of up to 4 (2 on AVX2) tokens x kColumns columns: buffer[t, r]
// broadcast against row r of the chunk, so a tile's outputs stay in the lanes of its registers.
// The scratch is kept between calls (no allocation per call once it has grown).
//
// Every output element is the same fixed chain of operations however many tokens share its
// tile, segment or step, and whichever thread runs it: a token's result does not depend on the
// rest of the batch, and two runs of a step give the same bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#include "widen.h"
#include "work_sharing.h"

namespace {

// Explicit intrinsics (not at::vec's wrapper), as in gemm.cpp: arrays of them stay in registers.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
constexpr int64_t kLanes = 16;
constexpr int kShrinkTokens = 4;  // 16 accumulators + 4 rank vectors + 1 token vector
constexpr int kExpandTokens = 4;  // 16 accumulators + 4 weight vectors + 1 broadcast
inline Reg zero() { return _mm512_setzero_ps(); }
inline Reg loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg broadcast(float x) { return _mm512_set1_ps(x); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline float lane_sum(Reg v) { return _mm512_reduce_add_ps(v); }
#else
using Reg = __m256;
constexpr int64_t kLanes = 8;
constexpr int kShrinkTokens = 2;  // 8 accumulators + 4 rank vectors + 1 token vector
constexpr int kExpandTokens = 2;  // 8 accumulators + 4 weight vectors + 1 broadcast
inline Reg zero() { return _mm256_setzero_ps(); }
inline Reg loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg broadcast(float x) { return _mm256_set1_ps(x); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline float lane_sum(Reg v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
static_assert(widen::W == kLanes, "widen.h and this file must see one vector width");

constexpr int kShrinkRanks = 4;            // ranks per shrink tile
constexpr int64_t kShrinkTokenBlock = 16;  // tokens per shrink work item
constexpr int64_t kShrinkRankBlock = 16;   // ranks per shrink work item
constexpr int64_t kExpandVectors = 4;      // vectors of output columns per expand tile
constexpr int64_t kColumns = kExpandVectors * kLanes;  // output columns per expand work item
constexpr int64_t kExpandTokenBlock = 128;  // tokens per expand work item (one transposition)
// Multiply-adds a thread's share must hold before a second thread is worth waking (about a
// microsecond of work; a decode step's small segments stay on the calling thread).
constexpr int64_t kParallelWork = int64_t{1} << 16;

// Eight float32 values from 8 consecutive elements (bfloat16 widened exactly: its bits are a
// float's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// --- shrink: dot products over K ----------------------------------------------------------

// One step of K for a dot product of element type T: `In` holds kStep elements of x or A,
// `madd` adds their products into float32 lanes; `load_tail` reads the n < kStep left, zeros
// after them.
template <typename T>
struct DotStep;

#if defined(CPU_CAPABILITY_AVX512)
template <>
struct DotStep<float> {
  using In = __m512;
  static constexpr int64_t kStep = 16;
  static In load(const float* p) { return _mm512_loadu_ps(p); }
  static In load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static Reg madd(Reg acc, In x, In a) { return _mm512_fmadd_ps(x, a, acc); }
};

template <>
struct DotStep<at::BFloat16> {
  using In = __m512i;
  static constexpr int64_t kStep = 32;
  static In load(const at::BFloat16* p) { return _mm512_loadu_si512(p); }
  static In load_tail(const at::BFloat16* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << n) - 1), p);
  }
  // Lane i += x[2i] * a[2i] + x[2i + 1] * a[2i + 1] (vdpbf16ps).
  static Reg madd(Reg acc, In x, In a) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(x), reinterpret_cast<__m512bh&>(a));
  }
};
#else
template <>
struct DotStep<float> {
  using In = __m256;
  static constexpr int64_t kStep = 8;
  static In load(const float* p) { return _mm256_loadu_ps(p); }
  static In load_tail(const float* p, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static Reg madd(Reg acc, In x, In a) { return _mm256_fmadd_ps(x, a, acc); }
};

template <>
struct DotStep<at::BFloat16> {
  using In = __m256;
  static constexpr int64_t kStep = 8;
  static In load(const at::BFloat16* p) { return load8(p); }
  static In load_tail(const at::BFloat16* p, int64_t n) {
    at::BFloat16 part[8] = {};
    std::memcpy(part, p, n * sizeof(at::BFloat16));
    return load8(part);
  }
  static Reg madd(Reg acc, In x, In a) { return _mm256_fmadd_ps(x, a, acc); }
};
#endif

// One step of K at k for TR tokens x RR ranks (rank r's row of A at a + r * K).
template <int TR, int RR, typename T, typename Load>
inline void shrink_step(Reg (&acc)[TR][RR], const T* const* x, const T* a, int64_t K, int64_t k,
                        const Load& load) {
  typename DotStep<T>::In w[RR];
  for (int r = 0; r < RR; ++r) w[r] = load(a + r * K + k);
  for (int t = 0; t < TR; ++t) {
    const auto xv = load(x[t] + k);
    for (int r = 0; r < RR; ++r) acc[t][r] = DotStep<T>::madd(acc[t][r], xv, w[r]);
  }
}

// out[t][r] = x[t] . A[r] for TR token rows x and RR consecutive rank rows of A at a.
template <int TR, int RR, typename T>
inline void shrink_tile(const T* const* x, const T* a, int64_t K, float* const* out) {
  using D = DotStep<T>;
  Reg acc[TR][RR];
  for (int t = 0; t < TR; ++t) {
    for (int r = 0; r < RR; ++r) acc[t][r] = zero();
  }
  int64_t k = 0;
  for (; k + D::kStep <= K; k += D::kStep) {
    shrink_step<TR, RR>(acc, x, a, K, k, [](const T* p) { return D::load(p); });
  }
  if (k < K) {
    const int64_t left = K - k;
    shrink_step<TR, RR>(acc, x, a, K, k, [left](const T* p) { return D::load_tail(p, left); });
  }
  for (int t = 0; t < TR; ++t) {
    for (int r = 0; r < RR; ++r) out[t][r] = lane_sum(acc[t][r]);
  }
}

// Ranks [r0, r1) of TR tokens: out[t] is token t's output row.
template <int TR, typename T>
void shrink_ranks(const T* const* x, const T* a, int64_t K, int64_t r0, int64_t r1,
                  float* const* out) {
  float* o[TR];
  int64_t r = r0;
  for (; r + kShrinkRanks <= r1; r += kShrinkRanks) {
    for (int t = 0; t < TR; ++t) o[t] = out[t] + r;
    shrink_tile<TR, kShrinkRanks>(x, a + r * K, K, o);
  }
  for (; r < r1; ++r) {
    for (int t = 0; t < TR; ++t) o[t] = out[t] + r;
    shrink_tile<TR, 1>(x, a + r * K, K, o);
  }
}

// fn(std::integral_constant<int, n>) for a run-time n in [1, Max].
template <int Max, typename Fn>
inline void with_count(int n, const Fn& fn) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, fn);
  }
  fn(std::integral_constant<int, Max>{});
}

// --- the step's segments ------------------------------------------------------------------

// The mapping's segments, read on the host: segment g is slot slots[g] over the tokens
// tokens[starts[g] .. starts[g + 1]).
struct Segments {
  const int64_t* tokens;
  const int64_t* slots;
  const int64_t* starts;
  int64_t count;
  int64_t longest;

  int64_t begin(int64_t g) const { return starts[g]; }
  int64_t end(int64_t g) const { return starts[g + 1]; }
};

void check_index_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous(), "lora: ", name,
              " must be a contiguous 1-D int64 tensor (octavo.lora.mapping builds it)");
}

// Validates the mapping against num_tokens tokens and num_slots slots (an index out of range
// would write outside the tensors) and reads it.
Segments read_segments(const at::Tensor& sorted_tokens, const at::Tensor& segment_slots,
                       const at::Tensor& segment_starts, int64_t num_tokens, int64_t num_slots) {
  check_index_tensor(sorted_tokens, "sorted_tokens");
  check_index_tensor(segment_slots, "segment_slots");
  check_index_tensor(segment_starts, "segment_starts");
  const int64_t count = segment_slots.numel();
  TORCH_CHECK(segment_starts.numel() == count + 1, "lora: segment_starts must have one entry ",
              "more than segment_slots (", segment_starts.numel(), " for ", count, " segments)");
  Segments s{sorted_tokens.data_ptr<int64_t>(), segment_slots.data_ptr<int64_t>(),
             segment_starts.data_ptr<int64_t>(), count, 0};
  TORCH_CHECK(s.starts[0] == 0 && s.starts[count] <= sorted_tokens.numel(),
              "lora: segment_starts must run from 0 to at most len(sorted_tokens)");
  for (int64_t g = 0; g < count; ++g) {
    TORCH_CHECK(s.begin(g) <= s.end(g), "lora: segment_starts must not decrease");
    TORCH_CHECK(s.slots[g] >= 0 && s.slots[g] < num_slots, "lora: segment ", g, " reads slot ",
                s.slots[g], " but the stacked weights hold ", num_slots, " slots");
    s.longest = std::max(s.longest, s.end(g) - s.begin(g));
  }
  for (int64_t i = 0; i < s.starts[count]; ++i) {
    TORCH_CHECK(s.tokens[i] >= 0 && s.tokens[i] < num_tokens, "lora: sorted token ", s.tokens[i],
                " is outside the step's ", num_tokens, " tokens");
  }
  return s;
}

// Work items of (segment, token block, inner block), item = (g * token_blocks + tb) * inner + i;
// a token block past its segment's end is empty.
struct ItemGrid {
  int64_t token_block, token_blocks, inner;

  ItemGrid(const Segments& s, int64_t token_block, int64_t inner)
      : token_block(token_block),
        token_blocks((s.longest + token_block - 1) / token_block),
        inner(inner) {}

  int64_t size(const Segments& s) const { return s.count * token_blocks * inner; }
};

// fn(g, token range [begin, end), inner block) over every non-empty item, on as many threads as
// `work_per_item` multiply-adds an item pays for.
template <typename Fn>
void for_each_item(const Segments& s, const ItemGrid& grid, int64_t work_per_item, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item));
  OCTAVO_CPU_NAMESPACE::parallel_chunks(grid.size(s), grain, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t inner = item % grid.inner, rest = item / grid.inner;
      const int64_t g = rest / grid.token_blocks, tb = rest % grid.token_blocks;
      const int64_t begin = s.begin(g) + tb * grid.token_block;
      const int64_t end = std::min(s.end(g), begin + grid.token_block);
      if (begin < end) fn(g, begin, end, inner);
    }
  });
}

// --- shrink op ----------------------------------------------------------------------------

template <typename T>
struct ShrinkProblem {
  const T* x;
  int64_t x_stride;
  const T* a;  // [S, R, K]
  int64_t R, K;
  float* out;
  int64_t out_stride;
};

// Sorted tokens [begin, end) of segment g against ranks [r0, r1) of its slot's A.
template <typename T>
void shrink_block(const ShrinkProblem<T>& p, const Segments& s, int64_t g, int64_t begin,
                  int64_t end, int64_t r0, int64_t r1) {
  const T* a = p.a + s.slots[g] * p.R * p.K;
  for (int64_t i = begin; i < end; i += kShrinkTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kShrinkTokens, end - i));
    const T* x[kShrinkTokens];
    float* out[kShrinkTokens];
    for (int t = 0; t < n; ++t) {
      x[t] = p.x + s.tokens[i + t] * p.x_stride;
      out[t] = p.out + s.tokens[i + t] * p.out_stride;
    }
    with_count<kShrinkTokens>(n, [&](auto tokens) {
      shrink_ranks<decltype(tokens)::value>(x, a, p.K, r0, r1, out);
    });
  }
}

template <typename T>
void shrink_segments(const ShrinkProblem<T>& p, const Segments& s) {
  const ItemGrid grid(s, kShrinkTokenBlock, (p.R + kShrinkRankBlock - 1) / kShrinkRankBlock);
  const int64_t work = std::min(s.longest, kShrinkTokenBlock) * std::min(p.R, kShrinkRankBlock) *
                       p.K;
  for_each_item(s, grid, work, [&](int64_t g, int64_t begin, int64_t end, int64_t rb) {
    const int64_t r0 = rb * kShrinkRankBlock;
    shrink_block(p, s, g, begin, end, r0, std::min(p.R, r0 + kShrinkRankBlock));
  });
}

// Rows of out whose token has no adapter (token_slots < 0) become zeros; a sorted token's
// slot must be its segment's.
void zero_base_rows(at::Tensor& out, const at::Tensor& token_slots, const Segments& s) {
  check_index_tensor(token_slots, "token_slots");
  TORCH_CHECK(token_slots.numel() == out.size(0), "lora_shrink: token_slots has ",
              token_slots.numel(), " entries for ", out.size(0), " tokens");
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < s.count; ++g) {
    for (int64_t i = s.begin(g); i < s.end(g); ++i) {
      TORCH_CHECK(slot_of[s.tokens[i]] == s.slots[g], "lora_shrink: token ", s.tokens[i],
                  " is in slot ", s.slots[g], "'s segment but token_slots says ",
                  slot_of[s.tokens[i]], "; build the mapping with build_lora_mapping");
    }
  }
  float* o = out.data_ptr<float>();
  const int64_t R = out.size(1), stride = out.stride(0);
  for (int64_t t = 0; t < out.size(0); ++t) {
    if (slot_of[t] < 0) std::memset(o + t * stride, 0, R * sizeof(float));
  }
}

// The products over x and A in their dtype, into out (float32, contiguous rows).
void shrink_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const Segments& s) {
  const int64_t R = a.size(1), K = a.size(2);
  if (x.scalar_type() == at::kFloat) {
    shrink_segments(ShrinkProblem<float>{x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(),
                                         R, K, out.data_ptr<float>(), out.stride(0)},
                    s);
  } else if (x.scalar_type() == at::kBFloat16) {
    shrink_segments(ShrinkProblem<at::BFloat16>{x.data_ptr<at::BFloat16>(), x.stride(0),
                                                a.data_ptr<at::BFloat16>(), R, K,
                                                out.data_ptr<float>(), out.stride(0)},
                    s);
  } else {
    TORCH_CHECK(false, "lora_shrink: float32 or bfloat16 inputs, not ", x.scalar_type(),
                " (octavo.ops.reference.lora_shrink takes any dtype)");
  }
}

// [T, R] float32 = x[T, K] @ a_stacked[slot(t)]^T per token, zeros where token_slots is
// negative; x and a_stacked share the model dtype. A new tensor (aliasing no input), made here
// rather than by the caller: torch.empty from Python costs as much as a decode step's shrink.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a_stacked,
                       const at::Tensor& token_slots, const at::Tensor& sorted_tokens,
                       const at::Tensor& segment_slots, const at::Tensor& segment_starts) {
  TORCH_CHECK(x.dim() == 2 && a_stacked.dim() == 3,
              "lora_shrink: x must be [T, K] and a_stacked [S, R, K]");
  const int64_t T = x.size(0), K = x.size(1), S = a_stacked.size(0), R = a_stacked.size(1);
  TORCH_CHECK(a_stacked.size(2) == K, "lora_shrink: x ", x.sizes(), " and a_stacked ",
              a_stacked.sizes(), " do not match");
  TORCH_CHECK(x.scalar_type() == a_stacked.scalar_type(), "lora_shrink: x is ",
              x.scalar_type(), " but a_stacked is ", a_stacked.scalar_type(),
              "; both must be in the model dtype");
  at::Tensor out = at::empty({T, R}, x.options().dtype(at::kFloat));
  const Segments s = read_segments(sorted_tokens, segment_slots, segment_starts, T, S);
  zero_base_rows(out, token_slots, s);
  if (s.longest == 0 || R == 0) return out;
  // Rows may be strided; a copy only where elements within a row are not contiguous.
  shrink_into(out, x.stride(1) == 1 ? x : x.contiguous(), a_stacked.contiguous(), s);
  return out;
}

// --- expand: B's rows transposed per chunk of columns -------------------------------------

// The rows of an 8 x 8 block (rows j of src, R apart) as eight float32 registers in the lanes
// the transposition wants: half[h] holds columns 0-3 of rows h and h + 4 (its 128-bit halves),
// half[h + 4] their columns 4-7. Rows are paired by 128-bit loads, no cross-lane shuffles.
inline void load_block(const float* src, int64_t R, __m256 (&half)[8]) {
  for (int h = 0; h < 4; ++h) {
    for (int c = 0; c < 2; ++c) {
      const __m128 upper = _mm_loadu_ps(src + (h + 4) * R + 4 * c);
      half[h + 4 * c] =
          _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(src + h * R + 4 * c)), upper, 1);
    }
  }
}

// bfloat16 widened on the way: a value in a float's upper 16 bits is that float exactly.
inline void load_block(const at::BFloat16* src, int64_t R, __m256 (&half)[8]) {
  const __m256i zeros = _mm256_setzero_si256();
  for (int h = 0; h < 4; ++h) {
    const __m128i upper = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (h + 4) * R));
    const __m256i rows = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + h * R))),
        upper, 1);
    half[h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zeros, rows));
    half[h + 4] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zeros, rows));
  }
}

// dst[r * ld + j] = src[j * R + r] for an 8 x 8 block: rows j of src (R apart), columns r.
template <typename T>
inline void transpose8x8(const T* src, int64_t R, float* dst, int64_t ld) {
  __m256 half[8];
  load_block(src, R, half);
  for (int c = 0; c < 8; c += 4) {  // columns c .. c + 3 of all eight rows
    const __m256 r01_lo = _mm256_unpacklo_ps(half[c], half[c + 1]);
    const __m256 r01_hi = _mm256_unpackhi_ps(half[c], half[c + 1]);
    const __m256 r23_lo = _mm256_unpacklo_ps(half[c + 2], half[c + 3]);
    const __m256 r23_hi = _mm256_unpackhi_ps(half[c + 2], half[c + 3]);
    _mm256_storeu_ps(dst + c * ld, _mm256_shuffle_ps(r01_lo, r23_lo, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(dst + (c + 1) * ld,
                     _mm256_shuffle_ps(r01_lo, r23_lo, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(dst + (c + 2) * ld,
                     _mm256_shuffle_ps(r01_hi, r23_hi, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(dst + (c + 3) * ld,
                     _mm256_shuffle_ps(r01_hi, r23_hi, _MM_SHUFFLE(3, 2, 3, 2)));
  }
}

// bt[r * kColumns + j] = B[j, r] in float32 for the `cols` rows of B at b (R values each), and
// zeros for j in [cols, kColumns).
template <typename T>
void transpose_chunk(const T* b, int64_t R, int64_t cols, float* bt) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    int64_t r = 0;
    for (; r + 8 <= R; r += 8) transpose8x8(b + j * R + r, R, bt + r * kColumns + j, kColumns);
    for (; r < R; ++r) {
      for (int64_t i = j; i < j + 8; ++i) bt[r * kColumns + i] = static_cast<float>(b[i * R + r]);
    }
  }
  for (; j < kColumns; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      bt[r * kColumns + j] = j < cols ? static_cast<float>(b[j * R + r]) : 0.f;
    }
  }
}

// y[0, cols) = round(y + acc) for one token's kColumns sums (only the first cols written).
template <typename T>
inline void add_rounded(T* y, const Reg* acc, int64_t cols) {
  for (int64_t v = 0; v < kExpandVectors; ++v) {
    T* dst = y + v * kLanes;
    const int64_t left = cols - v * kLanes;
    if (left >= kLanes) {
      widen::store(dst, widen::load(dst) + widen::Vec(acc[v]));
    } else if (left > 0) {
      float sums[kLanes];
      storeu(sums, acc[v]);
      for (int64_t i = 0; i < left; ++i) {
        dst[i] = static_cast<T>(static_cast<float>(dst[i]) + sums[i]);
      }
    }
  }
}

// TT tokens (buffer rows buf[t], y windows y[t]) over one transposed chunk bt of cols columns.
template <int TT, typename T>
inline void expand_tile(const float* const* buf, T* const* y, const float* bt, int64_t R,
                        int64_t cols) {
  Reg acc[TT][kExpandVectors];
  for (int t = 0; t < TT; ++t) {
    for (int64_t v = 0; v < kExpandVectors; ++v) acc[t][v] = zero();
  }
  for (int64_t r = 0; r < R; ++r) {
    Reg w[kExpandVectors];
    for (int64_t v = 0; v < kExpandVectors; ++v) w[v] = loadu(bt + r * kColumns + v * kLanes);
    for (int t = 0; t < TT; ++t) {
      const Reg scale = broadcast(buf[t][r]);
      for (int64_t v = 0; v < kExpandVectors; ++v) acc[t][v] = fma(scale, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < TT; ++t) add_rounded(y[t], acc[t], cols);
}

template <typename T>
struct ExpandProblem {
  T* y;  // at column `offset` of row 0
  int64_t y_stride;
  const float* buffer;
  int64_t buffer_stride;
  const T* b;  // [S, N, R]
  int64_t N, R;
};

// Sorted tokens [begin, end) of segment g against output columns [c * kColumns, + kColumns).
template <typename T>
void expand_block(const ExpandProblem<T>& p, const Segments& s, int64_t g, int64_t begin,
                  int64_t end, int64_t c) {
  thread_local std::vector<float> scratch;  // kept between calls: no allocation per call
  if (static_cast<int64_t>(scratch.size()) < p.R * kColumns) scratch.resize(p.R * kColumns);
  const int64_t n0 = c * kColumns, cols = std::min(kColumns, p.N - n0);
  transpose_chunk(p.b + (s.slots[g] * p.N + n0) * p.R, p.R, cols, scratch.data());
  for (int64_t i = begin; i < end; i += kExpandTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kExpandTokens, end - i));
    const float* buf[kExpandTokens];
    T* y[kExpandTokens];
    for (int t = 0; t < n; ++t) {
      buf[t] = p.buffer + s.tokens[i + t] * p.buffer_stride;
      y[t] = p.y + s.tokens[i + t] * p.y_stride + n0;
    }
    with_count<kExpandTokens>(n, [&](auto tokens) {
      expand_tile<decltype(tokens)::value>(buf, y, scratch.data(), p.R, cols);
    });
  }
}

template <typename T>
void expand_segments(const ExpandProblem<T>& p, const Segments& s) {
  const ItemGrid grid(s, kExpandTokenBlock, (p.N + kColumns - 1) / kColumns);
  // A transposition costs about as much as a few tokens' products.
  const int64_t work = (std::min(s.longest, kExpandTokenBlock) + 4) * kColumns * p.R;
  for_each_item(s, grid, work, [&](int64_t g, int64_t begin, int64_t end, int64_t c) {
    expand_block(p, s, g, begin, end, c);
  });
}

// The products over y's window (contiguous rows) and B in their dtype.
void expand_into(at::Tensor& y, const at::Tensor& buffer, const at::Tensor& b, int64_t offset,
                 const Segments& s) {
  const int64_t N = b.size(1), R = b.size(2);
  if (y.scalar_type() == at::kFloat) {
    expand_segments(ExpandProblem<float>{y.data_ptr<float>() + offset, y.stride(0),
                                         buffer.data_ptr<float>(), buffer.stride(0),
                                         b.data_ptr<float>(), N, R},
                    s);
  } else if (y.scalar_type() == at::kBFloat16) {
    expand_segments(ExpandProblem<at::BFloat16>{y.data_ptr<at::BFloat16>() + offset, y.stride(0),
                                                buffer.data_ptr<float>(), buffer.stride(0),
                                                b.data_ptr<at::BFloat16>(), N, R},
                    s);
  } else {
    TORCH_CHECK(false, "lora_expand: float32 or bfloat16 y, not ", y.scalar_type(),
                " (octavo.ops.reference.lora_expand takes any dtype)");
  }
}

// y[t, offset : offset + N] += buffer[t] @ b_stacked[slot(t)]^T for each sorted token: the
// product in float32, added to y in float32 and rounded once to y's dtype. buffer [T, R] is
// float32 (rows may be strided: a column slice of a wider shrink), y [T, >= offset + N] in the
// model dtype (rows may be strided), b_stacked [S, N, R] in y's dtype.
void lora_expand(at::Tensor y, const at::Tensor& buffer, const at::Tensor& b_stacked,
                 const at::Tensor& sorted_tokens, const at::Tensor& segment_slots,
                 const at::Tensor& segment_starts, int64_t offset) {
  TORCH_CHECK(y.dim() == 2 && buffer.dim() == 2 && b_stacked.dim() == 3,
              "lora_expand: y must be [T, width], buffer [T, R] and b_stacked [S, N, R]");
  const int64_t T = y.size(0), S = b_stacked.size(0), N = b_stacked.size(1);
  const int64_t R = b_stacked.size(2);
  TORCH_CHECK(buffer.size(0) == T && buffer.size(1) == R && offset >= 0 &&
                  offset + N <= y.size(1),
              "lora_expand: y ", y.sizes(), ", buffer ", buffer.sizes(), ", b_stacked ",
              b_stacked.sizes(), " and offset ", offset, " do not match");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat, "lora_expand: buffer must be float32 (what ",
              "lora_shrink returns), not ", buffer.scalar_type());
  TORCH_CHECK(y.scalar_type() == b_stacked.scalar_type(), "lora_expand: y is ", y.scalar_type(),
              " but b_stacked is ", b_stacked.scalar_type(), "; both must be in the model dtype");
  const Segments s = read_segments(sorted_tokens, segment_slots, segment_starts, T, S);
  if (s.longest == 0 || N == 0) return;
  // Rows may be strided; a copy only where elements within a row are not contiguous (y's is
  // written back whole: its other elements keep their bits).
  at::Tensor target = y.stride(1) == 1 ? y : y.contiguous();
  expand_into(target, buffer.stride(1) == 1 ? buffer : buffer.contiguous(),
              b_stacked.contiguous(), offset, s);
  if (!target.is_same(y)) y.copy_(target);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(OCTAVO_CPU_NAMESPACE, m) {
  m.def(
      "lora_shrink(Tensor x, Tensor a_stacked, Tensor token_slots, Tensor sorted_tokens, "
      "Tensor segment_slots, Tensor segment_starts) -> Tensor");
  m.def(
      "lora_expand(Tensor(a!) y, Tensor buffer, Tensor b_stacked, Tensor sorted_tokens, "
      "Tensor segment_slots, Tensor segment_starts, int offset) -> ()");
  m.impl("lora_shrink", c10::DispatchKey::CPU, &lora_shrink);
  m.impl("lora_expand", c10::DispatchKey::CPU, &lora_expand);
}

// Ragged paged attention for the CPU (prefill chunks and decodes of one packed batch), called
// from XLA as an FFI custom call.
//
// Sequence s owns query rows [qsl[s], qsl[s+1]): the last q_len of its seq_lens[s] tokens. The
// query at position p attends keys max(0, p - W + 1) .. p read straight from the paged cache
// [N, 2, Hkv, bs, D]. Work items are (sequence, tile of up to 32 query rows, KV head); the G
// query heads of a group share every page read. Keys go in chunks of 64 across page borders
// with one online-softmax update per chunk.
//   * Decode-like items (fewer than 16 query vectors): per query vector, a 16-lane vector of
//     partial q.k sums per key and one transposing tree of adds for 16 keys (transpose_sum);
//     the p.v sums of a row's GQA heads, in blocks of up to 4, share every V vector loaded.
//     Over a bf16 cache, queries whose values are bf16 (a bf16 model's) take q.k as AVX512-BF16
//     dot products on the K rows in place, where the build has them (chunk_rows_bf16), and
//     p.v widens each V vector in registers (no widened copy of the chunk).
//   * Prefill tiles: the chunk's K is transposed once into [D, 64]; the heads of a row's GQA
//     group, in blocks of up to 4, score 64 keys with broadcast-q FMAs and sum p.v together,
//     so each loaded K / V vector feeds up to 4 FMAs. With bf16 queries over a bf16 cache, K
//     is transposed as pairs of bf16 into [D / 2, 64] and scored by AVX512-BF16 dot products
//     (chunk_transposed_bf16).
// Built on first use by pallas_kernels/cpu_backend.py (c++ -O3 -march=native); the Python side
// validates shapes and dtypes, this file re-checks what it relies on and clamps indices.
//
// Why it exists: XLA:CPU runs the decode q.k / p.v of small GQA groups as YNNPACK reductions at
// ~10-20 GFLOP/s after gathering every page into a buffer, and its prefill tiles compute whole
// causal squares; numbers in benchmarks/RESULTS.md.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadSize = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxBlockSize = 256;
constexpr int kLanes = 16;     // keys scored together by transpose_sum
constexpr int kChunk = 64;     // keys per online-softmax update
constexpr int kTileRows = 32;  // query rows per prefill work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum StorageType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, u;
  if (exponent == 0) {
    if (mantissa == 0) {
      u = sign;
    } else {  // subnormal half: normalise
      int shift = 0;
      while (!(mantissa & 0x400u)) { mantissa <<= 1; ++shift; }
      u = sign | static_cast<uint32_t>(127 - 15 + 1 - shift) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 31) {
    u = sign | 0x7f800000u | mantissa << 13;
  } else {
    u = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) for x <= 0, vectorisable: 2^n * p(r) with a degree-7 Taylor polynomial on
// |r| <= ln2 / 2 (relative error < 1e-7). Below -87 the result is 0 (f32 underflow).
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float r = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

struct Problem {
  const float* q;          // [T, Hq, D]
  const uint8_t* kv;       // [N, 2, Hkv, bs, D] pages, `storage` elements
  const int32_t* tables;   // [S, B]
  float* out;              // [T, Hq, D]
  int64_t num_blocks, width;
  int q_heads, kv_heads, head_size, block_size, itemsize;
  int32_t storage;
  int window;              // sliding window in keys; 0: none
  float scale, soft_cap;   // soft_cap <= 0: none
};

// Query rows [row0, row0 + nq) of sequence s at positions pos0.., KV head h.
struct Item {
  int32_t s, row0, nq, pos0, h;
};

// Keys of the query at position `pos`: [lo, hi).
inline int key_lo(const Problem& p, int pos) { return p.window > 0 ? std::max(0, pos - p.window + 1) : 0; }

// One chunk of n <= kChunk keys as f32 row pointers; entries n .. round_up(n, kLanes) repeat
// the last row (read, then masked), so the vector code needs no tails.
struct Chunk {
  const float* k[kChunk];
  const float* v[kChunk];
  const uint16_t* kb[kChunk];  // the bf16 rows of K and V, in place (the bf16 kernels only)
  const uint16_t* vb[kChunk];
  int n;
};

// Online-softmax update with logits [n_pad] whose entries outside [a, b) are ignored: m, l
// updated, logit overwritten with the weights exp(logit - m_new) (0 outside [a, b)). Returns
// the factor that rescales the old accumulator.
inline float softmax_update(float* logit, int a, int b, int n_pad, float soft_cap, float& m, float& l) {
  if (soft_cap > 0.0f) {
    const float inv = 1.0f / soft_cap;
    for (int t = a; t < b; ++t) logit[t] = soft_cap * std::tanh(logit[t] * inv);
  }
  for (int t = 0; t < a; ++t) logit[t] = kNegInf;
  for (int t = b; t < n_pad; ++t) logit[t] = kNegInf;
  // Lane-wise max, then across lanes (a plain max reduction stays scalar).
  alignas(64) float lane_max[kLanes];
  for (int i = 0; i < kLanes; ++i) lane_max[i] = m;
  int t = 0;
  for (; t + kLanes <= n_pad; t += kLanes)
    for (int i = 0; i < kLanes; ++i) lane_max[i] = std::max(lane_max[i], logit[t + i]);
  for (; t < n_pad; ++t) lane_max[0] = std::max(lane_max[0], logit[t]);
  float mx = lane_max[0];
  for (int i = 1; i < kLanes; ++i) mx = std::max(mx, lane_max[i]);
  const float corr = m == kNegInf ? 0.0f : exp_nonpositive(m - mx);
  m = mx;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n_pad; ++i) {
    logit[i] = exp_nonpositive(logit[i] - mx);
    sum += logit[i];
  }
  l = l * corr + sum;
  return corr;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define JAXKV_VECTOR_KERNELS 1
// 16-lane float vectors (GCC / Clang vector extensions: AVX-512, 2 x AVX2 or 4 x NEON).
typedef float v16 __attribute__((vector_size(kLanes * sizeof(float))));
typedef float v16u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));
inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

// Lane j of the result = the sum of the lanes of P[bitrev4(j)]: 4 levels of 2 shuffles + 1 add
// per output vector instead of 16 horizontal sums. Store key t's partial sums at P[kBitrev4[t]]
// and lane t is key t's logit.
constexpr int kBitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline v16 transpose_sum(const v16* P) {
  v16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(P[2 * i], P[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(P[2 * i], P[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                   15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}

// acc = acc * corr + sum_t w[t] * v[t] over t < n_pad (w = 0 where masked); two accumulator
// sets (even / odd keys) so that the FMA chains overlap.
template <int NC>
inline void accumulate_pv(const float* w, const float* const* v, int n_pad, float corr, float* acc) {
  v16 a0[NC], a1[NC];
  for (int j = 0; j < NC; ++j) {
    a0[j] = load16(acc + j * kLanes) * corr;
    a1[j] = v16{};
  }
  for (int t = 0; t < n_pad; t += 2) {
    const float *v0 = v[t], *v1 = v[t + 1];
    for (int j = 0; j < NC; ++j) {
      a0[j] += w[t] * load16(v0 + j * kLanes);
      a1[j] += w[t + 1] * load16(v1 + j * kLanes);
    }
  }
  for (int j = 0; j < NC; ++j) store16(acc + j * kLanes, a0[j] + a1[j]);
}

// acc[g] = acc[g] * corr[g] + sum_t w[g][t] * v[t] for GB query vectors of one row (GQA heads,
// stride D in acc): each V vector loaded (load(row) -> v16: f32 rows, or bf16 rows widened in
// registers) feeds GB FMAs, in register blocks of <= 16 accumulators.
template <int NC, int GB, typename T, typename Load>
inline void accumulate_pv_blocks(const float (*w)[kChunk], const T* const* v, int n_pad,
                                 const float* corr, float* acc, Load load) {
  constexpr int D = NC * kLanes;
  constexpr int JB = NC < 16 / GB ? NC : 16 / GB;  // vectors of D per register block
  for (int j0 = 0; j0 < NC; j0 += JB) {
    const int nj = NC - j0 < JB ? NC - j0 : JB;
    v16 o[GB][JB];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < JB; ++j)
        if (j < nj) o[g][j] = load16(acc + g * D + (j0 + j) * kLanes) * corr[g];
    for (int t = 0; t < n_pad; ++t) {
      const T* vr = v[t] + j0 * kLanes;
      v16 x[JB];
      for (int j = 0; j < JB; ++j)
        if (j < nj) x[j] = load(vr + j * kLanes);
      for (int g = 0; g < GB; ++g) {
        const float wt = w[g][t];
        for (int j = 0; j < JB; ++j)
          if (j < nj) o[g][j] += wt * x[j];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < JB; ++j)
        if (j < nj) store16(acc + g * D + (j0 + j) * kLanes, o[g][j]);
  }
}

// accumulate_pv_blocks over f32 V rows; one query vector keeps two accumulator sets.
template <int NC, int GB>
inline void accumulate_pv_group(const float (*w)[kChunk], const float* const* v, int n_pad,
                                const float* corr, float* acc) {
  if constexpr (GB == 1) {
    accumulate_pv<NC>(w[0], v, n_pad, corr[0], acc);
  } else {
    accumulate_pv_blocks<NC, GB>(w, v, n_pad, corr, acc, [](const float* r) { return load16(r); });
  }
}

// GB query vectors of one row (heads of one GQA group: same keys, same mask [a, b)) over the
// first NV * 16 keys of a chunk whose K is transposed to kt [D, kChunk] (prefill tiles). Every
// K and V vector loaded feeds GB FMAs (q elements / weights broadcast), so the loop is not
// bound by loads: NV vectors of logits per query, then the p.v sums in register blocks of up to
// 16 accumulators. GB == 1 keeps two accumulator sets (even / odd elements) so that its FMA
// chains overlap.
template <int NC, int GB, int NV>
void chunk_transposed_keys(const float* q, const float* kt, const Chunk& c, int a, int b,
                           float soft_cap, float* m, float* l, float* acc) {
  constexpr int D = NC * kLanes;
  constexpr int kSets = GB == 1 ? 2 : 1;
  constexpr int n_keys = NV * kLanes;
  v16 s[kSets][GB][NV] = {};
  for (int e = 0; e < D; e += kSets) {
    for (int u = 0; u < kSets; ++u) {
      v16 k[NV];
      for (int j = 0; j < NV; ++j) k[j] = load16(kt + (e + u) * kChunk + j * kLanes);
      for (int g = 0; g < GB; ++g) {
        const float qe = q[g * D + e + u];
        for (int j = 0; j < NV; ++j) s[u][g][j] += qe * k[j];
      }
    }
  }
  alignas(64) float logit[GB][kChunk];
  float corr[GB];
  for (int g = 0; g < GB; ++g) {
    for (int j = 0; j < NV; ++j) {
      v16 x = s[0][g][j];
      for (int u = 1; u < kSets; ++u) x += s[u][g][j];
      store16(logit[g] + j * kLanes, x);
    }
    corr[g] = softmax_update(logit[g], a, b, n_keys, soft_cap, m[g], l[g]);
  }
  accumulate_pv_group<NC, GB>(logit, c.v, n_keys, corr, acc);
}

// chunk_transposed_keys over the chunk's keys up to b rounded up to 16: the keys past b (the
// causal mask's, in a prompt's last chunk) would get weight exactly 0 (exp_nonpositive below
// -87), so leaving them out changes no sum.
template <int NC, int GB>
void chunk_transposed(const float* q, const float* kt, const Chunk& c, int a, int b,
                      float soft_cap, float* m, float* l, float* acc) {
  static_assert(kChunk == 4 * kLanes, "chunk_transposed takes 1-4 vectors of keys");
  switch ((std::min(b, c.n) + kLanes - 1) / kLanes) {
    case 1: chunk_transposed_keys<NC, GB, 1>(q, kt, c, a, b, soft_cap, m, l, acc); break;
    case 2: chunk_transposed_keys<NC, GB, 2>(q, kt, c, a, b, soft_cap, m, l, acc); break;
    case 3: chunk_transposed_keys<NC, GB, 3>(q, kt, c, a, b, soft_cap, m, l, acc); break;
    default: chunk_transposed_keys<NC, GB, 4>(q, kt, c, a, b, soft_cap, m, l, acc);
  }
}

// GB query vectors of one row (heads of one GQA group) over one chunk's keys [a, b) (decode
// items): head size 16 * NC known at compile time, so q and the partial sums stay in
// registers; the p.v sums share every V vector loaded (accumulate_pv_group).
template <int NC, int GB>
void chunk_rows(const float* q, const Chunk& c, int a, int b, float soft_cap, float* m, float* l,
                float* acc) {
  constexpr int D = NC * kLanes;
  const int n_pad = (c.n + kLanes - 1) / kLanes * kLanes;
  alignas(64) float logit[GB][kChunk];
  float corr[GB];
  for (int g = 0; g < GB; ++g) {
    v16 qv[NC];
    for (int j = 0; j < NC; ++j) qv[j] = load16(q + g * D + j * kLanes);
    for (int t0 = 0; t0 < n_pad; t0 += kLanes) {
      v16 part[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        const float* kr = c.k[t0 + t];
        v16 s = qv[0] * load16(kr);
        for (int j = 1; j < NC; ++j) s += qv[j] * load16(kr + j * kLanes);
        part[kBitrev4[t]] = s;
      }
      store16(logit[g] + t0, transpose_sum(part));
    }
    corr[g] = softmax_update(logit[g], a, b, n_pad, soft_cap, m[g], l[g]);
  }
  accumulate_pv_group<NC, GB>(logit, c.v, n_pad, corr, acc);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXKV_BF16_QK 1
#include <immintrin.h>
// 16 bf16 values widened to f32 (a bf16 is the top half of its f32).
inline v16 widen16(const uint16_t* p) {
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

// accumulate_pv_blocks on the bf16 V rows in place, each V vector widened in registers (no
// widened copy of the chunk is written and read back).
template <int NC, int GB>
inline void accumulate_pv_group_bf16(const float (*w)[kChunk], const uint16_t* const* v,
                                     int n_pad, const float* corr, float* acc) {
  accumulate_pv_blocks<NC, GB>(w, v, n_pad, corr, acc, [](const uint16_t* r) { return widen16(r); });
}

// chunk_rows for queries whose values are bf16 (a bf16 model's q) over a bf16 cache: q.k as
// AVX512-BF16 dot products on the K rows in place (no widening), each product exact in f32 as
// in the f32 FMAs (two roundings per pair of products where the FMAs make one each). `qb` holds
// the GB query vectors unscaled; the scale multiplies the logits. NC is even (32 bf16 a vector).
template <int NC, int GB>
void chunk_rows_bf16(const uint16_t* qb, float scale, const Chunk& c, int a, int b,
                     float soft_cap, float* m, float* l, float* acc) {
  static_assert(NC % 2 == 0, "whole vectors of 32 bf16");
  constexpr int D = NC * kLanes, NB = NC / 2;
  const int n_pad = (c.n + kLanes - 1) / kLanes * kLanes;
  alignas(64) float logit[GB][kChunk];
  float corr[GB];
  for (int g = 0; g < GB; ++g) {
    __m512bh qv[NB];
    for (int j = 0; j < NB; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qb + g * D + j * 32);
    for (int t0 = 0; t0 < n_pad; t0 += kLanes) {
      v16 part[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        const uint16_t* kr = c.kb[t0 + t];
        __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                    (__m512bh)_mm512_loadu_si512(kr));
        for (int j = 1; j < NB; ++j)
          s = _mm512_dpbf16_ps(s, qv[j], (__m512bh)_mm512_loadu_si512(kr + j * 32));
        part[kBitrev4[t]] = (v16)s;
      }
      store16(logit[g] + t0, transpose_sum(part) * scale);
    }
    corr[g] = softmax_update(logit[g], a, b, n_pad, soft_cap, m[g], l[g]);
  }
  accumulate_pv_group_bf16<NC, GB>(logit, c.vb, n_pad, corr, acc);
}

// chunk_transposed_keys for bf16 queries over a bf16 cache (prefill tiles): kt2 [D / 2, kChunk]
// holds the chunk's K as pairs of bf16 (the 32-bit words of its rows, transposed), and each
// VDPBF16PS takes two elements of q.k for 16 keys: half the q.k instructions and half the
// transposition of the f32 kernel, and no widening of K. Numbers as in chunk_rows_bf16.
template <int NC, int GB, int NV>
void chunk_transposed_keys_bf16(const uint16_t* qb, float scale, const uint32_t* kt2,
                                const Chunk& c, int a, int b, float soft_cap, float* m, float* l,
                                float* acc) {
  static_assert(NC % 2 == 0, "whole vectors of 32 bf16");
  constexpr int D = NC * kLanes, pairs = D / 2;
  constexpr int n_keys = NV * kLanes;
  __m512 s[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) s[g][j] = _mm512_setzero_ps();
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
  for (int e = 0; e < pairs; ++e) {
    __m512bh k[NV];
    for (int j = 0; j < NV; ++j) k[j] = (__m512bh)_mm512_loadu_si512(kt2 + e * kChunk + j * kLanes);
    for (int g = 0; g < GB; ++g) {
      const __m512bh qe = (__m512bh)_mm512_set1_epi32(static_cast<int>(q32[g * pairs + e]));
      for (int j = 0; j < NV; ++j) s[g][j] = _mm512_dpbf16_ps(s[g][j], qe, k[j]);
    }
  }
  alignas(64) float logit[GB][kChunk];
  float corr[GB];
  for (int g = 0; g < GB; ++g) {
    for (int j = 0; j < NV; ++j) store16(logit[g] + j * kLanes, (v16)s[g][j] * scale);
    corr[g] = softmax_update(logit[g], a, b, n_keys, soft_cap, m[g], l[g]);
  }
  accumulate_pv_group<NC, GB>(logit, c.v, n_keys, corr, acc);
}

// chunk_transposed for chunk_transposed_keys_bf16 (the keys up to b rounded up to 16).
template <int NC, int GB>
void chunk_transposed_bf16(const uint16_t* qb, float scale, const uint32_t* kt2, const Chunk& c,
                           int a, int b, float soft_cap, float* m, float* l, float* acc) {
  switch ((std::min(b, c.n) + kLanes - 1) / kLanes) {
    case 1: chunk_transposed_keys_bf16<NC, GB, 1>(qb, scale, kt2, c, a, b, soft_cap, m, l, acc); break;
    case 2: chunk_transposed_keys_bf16<NC, GB, 2>(qb, scale, kt2, c, a, b, soft_cap, m, l, acc); break;
    case 3: chunk_transposed_keys_bf16<NC, GB, 3>(qb, scale, kt2, c, a, b, soft_cap, m, l, acc); break;
    default: chunk_transposed_keys_bf16<NC, GB, 4>(qb, scale, kt2, c, a, b, soft_cap, m, l, acc);
  }
}
#endif

using RowsKernel = void (*)(const float*, const Chunk&, int, int, float, float*, float*, float*);
using TransposedKernel = void (*)(const float*, const float*, const Chunk&, int, int, float,
                                  float*, float*, float*);
// Query vectors per chunk_rows / chunk_transposed call. 3 is its own block: a group of 3 (e.g.
// SmolLM2's 9 query / 3 KV heads) as 2 + 1 ran the chunk's V loop twice.
constexpr int kGroupBlocks[] = {4, 3, 2, 1};
constexpr int kNumGroupBlocks = 4;

// The instantiation of JAXKV_KERNEL for head size d_n and group block gb (nullptr: none).
#define JAXKV_HEAD_SIZES(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(10) X(12) X(16)
#define JAXKV_EVEN_HEAD_SIZES(X) X(2) X(4) X(6) X(8) X(10) X(12) X(16)
#define JAXKV_CASE(nc)                                                                   \
  if (d_n == nc * kLanes)                                                                \
    return gb == 4   ? JAXKV_KERNEL<nc, 4>                                                 \
           : gb == 3 ? JAXKV_KERNEL<nc, 3>                                                 \
           : gb == 2 ? JAXKV_KERNEL<nc, 2>                                                 \
                     : JAXKV_KERNEL<nc, 1>;
RowsKernel rows_kernel(int d_n, int gb) {
#define JAXKV_KERNEL chunk_rows
  JAXKV_HEAD_SIZES(JAXKV_CASE)
#undef JAXKV_KERNEL
  return nullptr;
}
TransposedKernel transposed_kernel(int d_n, int gb) {
#define JAXKV_KERNEL chunk_transposed
  JAXKV_HEAD_SIZES(JAXKV_CASE)
#undef JAXKV_KERNEL
  return nullptr;
}
#if JAXKV_BF16_QK
using RowsBf16Kernel = void (*)(const uint16_t*, float, const Chunk&, int, int, float, float*,
                                float*, float*);
RowsBf16Kernel rows_bf16_kernel(int d_n, int gb) {
#define JAXKV_KERNEL chunk_rows_bf16
  JAXKV_EVEN_HEAD_SIZES(JAXKV_CASE)
#undef JAXKV_KERNEL
  return nullptr;
}
using TransposedBf16Kernel = void (*)(const uint16_t*, float, const uint32_t*, const Chunk&, int,
                                      int, float, float*, float*, float*);
TransposedBf16Kernel transposed_bf16_kernel(int d_n, int gb) {
#define JAXKV_KERNEL chunk_transposed_bf16
  JAXKV_EVEN_HEAD_SIZES(JAXKV_CASE)
#undef JAXKV_KERNEL
  return nullptr;
}
#endif
#undef JAXKV_CASE
#else
#define JAXKV_VECTOR_KERNELS 0
#endif

// Any head size: the same update with plain loops.
void chunk_portable(const float* q, const Chunk& c, int a, int b, int d_n, float soft_cap,
                    float& m, float& l, float* acc) {
  alignas(64) float logit[kChunk];
  for (int t = a; t < b; ++t) {
    const float* kr = c.k[t];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int e = 0; e < d_n; ++e) dot += q[e] * kr[e];
    logit[t] = dot;
  }
  const float corr = softmax_update(logit, a, b, c.n, soft_cap, m, l);
#pragma omp simd
  for (int e = 0; e < d_n; ++e) acc[e] *= corr;
  for (int t = a; t < b; ++t) {
    const float w = logit[t];
    const float* vr = c.v[t];
#pragma omp simd
    for (int e = 0; e < d_n; ++e) acc[e] += w * vr[e];
  }
}

// Per-thread buffers: widened K / V rows of 16-bit caches, the transposed K of a chunk, and a
// tile's scaled queries and softmax state.
struct Scratch {
  std::vector<float> krows, vrows, kt, q, acc, m, l;
  std::vector<uint16_t> qb;  // the queries as bf16, unscaled (chunk_rows_bf16)
  explicit Scratch(int d_n, int group)
      : krows(kChunk * d_n), vrows(kChunk * d_n), kt(static_cast<size_t>(d_n) * kChunk),
        q(static_cast<size_t>(kTileRows) * group * d_n), acc(q.size()),
        m(kTileRows * group), l(kTileRows * group), qb(q.size()) {}

  // This thread's buffers for these sizes, kept between calls.
  static Scratch& of_thread(int d_n, int group) {
    thread_local std::unique_ptr<Scratch> scratch;
    thread_local int sizes[2] = {-1, -1};
    if (!scratch || sizes[0] != d_n || sizes[1] != group) {
      scratch = std::make_unique<Scratch>(d_n, group);
      sizes[0] = d_n;
      sizes[1] = group;
    }
    return *scratch;
  }
};

// The item's query vectors (row i, head g) -> index i * G + g; keys [lo, hi) of the whole tile.
void run_item(const Problem& p, const Item& it, Scratch& w) {
  const int group = p.q_heads / p.kv_heads, d_n = p.head_size, bs = p.block_size;
  const int nvec = it.nq * group;
  const int hi = std::min<int64_t>(it.pos0 + it.nq, p.width * bs);   // the table's keys only
  const int lo = key_lo(p, it.pos0);
  float* q = w.q.data();
  float* acc = w.acc.data();
  for (int i = 0; i < it.nq; ++i) {
    const float* qs = p.q + (static_cast<int64_t>(it.row0 + i) * p.q_heads + it.h * group) * d_n;
    for (int e = 0; e < group * d_n; ++e) q[i * group * d_n + e] = qs[e] * p.scale;
  }
  std::fill(acc, acc + nvec * d_n, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + nvec, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + nvec, 0.0f);
#if JAXKV_VECTOR_KERNELS
  const bool vector = rows_kernel(d_n, 1) != nullptr;
  const bool transposed = vector && nvec >= kLanes;
  RowsKernel rows_by_block[kNumGroupBlocks] = {};
  TransposedKernel by_block[kNumGroupBlocks] = {};
  for (int k = 0; vector && k < kNumGroupBlocks; ++k) {
    rows_by_block[k] = rows_kernel(d_n, kGroupBlocks[k]);
    by_block[k] = transposed_kernel(d_n, kGroupBlocks[k]);
  }
#else
  constexpr bool vector = false, transposed = false;
  constexpr RowsKernel rows_by_block[kNumGroupBlocks] = {};
  constexpr TransposedKernel by_block[kNumGroupBlocks] = {};
#endif
  // Over a bf16 cache, queries whose values are bf16 (their low 16 bits zero, as a bf16
  // model's q widened to f32): q.k on the bf16 K rows in place (decode rows), or on their
  // 32-bit pairs transposed (prefill tiles); K is never widened, and V only for the tiles
  // (each of whose rows reads it: widened once a chunk).
#if JAXKV_BF16_QK
  RowsBf16Kernel bf16_by_block[kNumGroupBlocks] = {};
  TransposedBf16Kernel transposed_bf16_by_block[kNumGroupBlocks] = {};
  bool qk_bf16 = vector && p.storage == kBF16 && rows_bf16_kernel(d_n, 1);
  for (int i = 0; qk_bf16 && i < it.nq; ++i) {
    const uint32_t* qs = reinterpret_cast<const uint32_t*>(
        p.q + (static_cast<int64_t>(it.row0 + i) * p.q_heads + it.h * group) * d_n);
    uint32_t low = 0;
    for (int e = 0; e < group * d_n; ++e) low |= qs[e] & 0xffffu;
    for (int e = 0; e < group * d_n; ++e) w.qb[i * group * d_n + e] = qs[e] >> 16;
    qk_bf16 = low == 0;
  }
  for (int k = 0; qk_bf16 && k < kNumGroupBlocks; ++k) {
    bf16_by_block[k] = rows_bf16_kernel(d_n, kGroupBlocks[k]);
    transposed_bf16_by_block[k] = transposed_bf16_kernel(d_n, kGroupBlocks[k]);
  }
#else
  constexpr bool qk_bf16 = false;
#endif
  const int64_t row_bytes = static_cast<int64_t>(d_n) * p.itemsize;
  const int64_t page_bytes = bs * row_bytes;
  const int32_t* table = p.tables + static_cast<int64_t>(it.s) * p.width;
  // K (kv = 0) or V (kv = 1) row of key `pos`. Table entries are trusted by the engine;
  // clamping keeps a bad one inside the cache.
  auto row = [&](int pos, int kv) {
    const int64_t blk = std::min<int64_t>(std::max<int32_t>(table[pos / bs], 0), p.num_blocks - 1);
    return p.kv + ((blk * 2 + kv) * p.kv_heads + it.h) * page_bytes + (pos % bs) * row_bytes;
  };
  auto prefetch = [&](int a, int b) {  // keys [a, b), page by page
    for (int pos = a; pos < b;) {
      const int end = std::min(b, (pos / bs + 1) * bs);
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* r = row(pos, kv);
        for (int64_t off = 0; off < (end - pos) * row_bytes; off += 64) __builtin_prefetch(r + off, 0, 3);
      }
      pos = end;
    }
  };
  Chunk c;
  prefetch(lo, std::min(hi, lo + kChunk));
  for (int c0 = lo; c0 < hi; c0 += kChunk) {
    c.n = std::min(kChunk, hi - c0);
    if (p.storage == kF32) prefetch(c0 + kChunk, std::min(hi, c0 + 2 * kChunk));  // the next chunk
    // A page's keys [pos, end) are contiguous rows: their addresses (and, for a 16-bit cache,
    // one widening pass over them) page by page.
    for (int pos = c0; pos < c0 + c.n;) {
      const int end = std::min(c0 + c.n, (pos / bs + 1) * bs), t0 = pos - c0, rows = end - pos;
      const uint8_t* kr = row(pos, 0);
      const uint8_t* vr = row(pos, 1);
      const int ahead = pos + kChunk;  // the key one chunk on
      pos = end;
      if (p.storage == kF32) {
        for (int t = 0; t < rows; ++t) {
          c.k[t0 + t] = reinterpret_cast<const float*>(kr + t * row_bytes);
          c.v[t0 + t] = reinterpret_cast<const float*>(vr + t * row_bytes);
          c.kb[t0 + t] = c.vb[t0 + t] = nullptr;
        }
        continue;
      }
      // Widened in runs of 32 values, each run prefetching a line of K and of V one chunk on
      // (spread this way, the prefetches overlap the widening: 0.67-0.72 against 0.84-0.89 ms
      // a layer for the prefetch of a whole chunk and row-by-row widening, benchmarks/RESULTS.md).
      // The lines go to L2 (prefetcht2), not L1: decode rows over bf16 widen nothing, so
      // their prefetches come in one burst a page, and into L2 they ran 0.52-0.55 against
      // 0.68-0.71 ms a layer (64 rows x 180 keys from memory; prefill tiles unchanged).
      const uint8_t* ka = ahead < hi ? row(ahead, 0) : nullptr;
      const uint8_t* va = ahead < hi ? row(ahead, 1) : nullptr;
      float* kd = w.krows.data() + t0 * d_n;
      float* vd = w.vrows.data() + t0 * d_n;
      const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kr);
      const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vr);
      const int count = rows * d_n;
      auto widen = [&](auto convert) {
        for (int e0 = 0; e0 < count; e0 += 32) {
          if (ka) {
            __builtin_prefetch(ka + 2 * e0, 0, 1);
            __builtin_prefetch(va + 2 * e0, 0, 1);
          }
          if (qk_bf16 && !transposed) continue;  // decode rows read K and V in place
          const int e1 = std::min(count, e0 + 32);
          if (qk_bf16) {  // prefill tiles read K in place; V, read by every row, is widened
            for (int e = e0; e < e1; ++e) vd[e] = convert(v16[e]);
            continue;
          }
          for (int e = e0; e < e1; ++e) { kd[e] = convert(k16[e]); vd[e] = convert(v16[e]); }
        }
      };
      if (p.storage == kBF16) widen([](uint16_t h) { return bf16_to_f32(h); });
      else widen([](uint16_t h) { return f16_to_f32(h); });
      for (int t = 0; t < rows; ++t) {
        c.k[t0 + t] = kd + t * d_n;
        c.v[t0 + t] = vd + t * d_n;
        c.kb[t0 + t] = k16 + t * d_n;
        c.vb[t0 + t] = v16 + t * d_n;
      }
    }
    const int n_pad = (c.n + kLanes - 1) / kLanes * kLanes;
    for (int t = c.n; t < n_pad; ++t) {
      c.k[t] = c.k[c.n - 1];
      c.v[t] = c.v[c.n - 1];
      c.kb[t] = c.kb[c.n - 1];
      c.vb[t] = c.vb[c.n - 1];
    }
    if (transposed && qk_bf16) {  // kt2[e][t] = the e-th pair of K[t]'s bf16; zero past n
      uint32_t* kt2 = reinterpret_cast<uint32_t*>(w.kt.data());
      const int pairs = d_n / 2;
      for (int t = 0; t < c.n; ++t) {
        const uint32_t* kr = reinterpret_cast<const uint32_t*>(c.kb[t]);
        for (int e = 0; e < pairs; ++e) kt2[e * kChunk + t] = kr[e];
      }
      for (int e = 0; e < pairs; ++e)
        std::fill(kt2 + e * kChunk + c.n, kt2 + (e + 1) * kChunk, 0u);
    } else if (transposed) {  // kt[e][t] = K[t][e]; zero past n (finite logits, masked later)
      float* kt = w.kt.data();
      for (int t = 0; t < c.n; ++t)
        for (int e = 0; e < d_n; ++e) kt[e * kChunk + t] = c.k[t][e];
      for (int e = 0; e < d_n; ++e)
        std::fill(kt + e * kChunk + c.n, kt + (e + 1) * kChunk, 0.0f);
    }
    for (int i = 0; i < it.nq; ++i) {
      const int pos = it.pos0 + i;
      const int a = std::max(key_lo(p, pos), c0) - c0, b = std::min(pos + 1, c0 + c.n) - c0;
      if (b <= a) continue;  // this row needs none of the chunk's keys
      if (vector) {  // the group's heads in blocks of 4, 2, 1
        for (int g = 0, k = 0; g < group;) {
          while (group - g < kGroupBlocks[k]) ++k;
          const int v = i * group + g;
#if JAXKV_BF16_QK
          if (transposed && qk_bf16)
            transposed_bf16_by_block[k](w.qb.data() + v * d_n, p.scale,
                                        reinterpret_cast<const uint32_t*>(w.kt.data()), c, a, b,
                                        p.soft_cap, &w.m[v], &w.l[v], acc + v * d_n);
          else
#endif
          if (transposed)
            by_block[k](q + v * d_n, w.kt.data(), c, a, b, p.soft_cap, &w.m[v], &w.l[v], acc + v * d_n);
#if JAXKV_BF16_QK
          else if (qk_bf16)
            bf16_by_block[k](w.qb.data() + v * d_n, p.scale, c, a, b, p.soft_cap, &w.m[v], &w.l[v],
                             acc + v * d_n);
#endif
          else
            rows_by_block[k](q + v * d_n, c, a, b, p.soft_cap, &w.m[v], &w.l[v], acc + v * d_n);
          g += kGroupBlocks[k];
        }
        continue;
      }
      for (int g = 0; g < group; ++g) {
        const int v = i * group + g;
        chunk_portable(q + v * d_n, c, a, b, d_n, p.soft_cap, w.m[v], w.l[v], acc + v * d_n);
      }
    }
  }
  for (int i = 0; i < it.nq; ++i) {
    float* out = p.out + (static_cast<int64_t>(it.row0 + i) * p.q_heads + it.h * group) * d_n;
    for (int g = 0; g < group; ++g) {
      const int v = i * group + g;
      const float inv = w.l[v] > 0.0f ? 1.0f / w.l[v] : 0.0f;
      for (int e = 0; e < d_n; ++e) out[g * d_n + e] = acc[v * d_n + e] * inv;
    }
  }
}

// Items cut into `parts` contiguous ranges of about equal cost (ParallelFor runs them).
struct Work {
  Problem p;
  std::vector<Item> items;
  std::vector<int64_t> cost;   // [items + 1] prefix sums of the items' costs
  int parts = 1;

  void run_part(int w) const {
    Scratch& scratch = Scratch::of_thread(p.head_size, p.q_heads / p.kv_heads);
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t c0 = cost[n] * w / parts, c1 = cost[n] * (w + 1) / parts;
    const int64_t first = std::lower_bound(cost.begin(), cost.end() - 1, c0) - cost.begin();
    for (int64_t i = first; i < n && cost[i] < c1; ++i) run_item(p, items[i], scratch);
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> num_seqs,
                              ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap,
                              int32_t sliding_window, int32_t storage, int32_t num_threads) {
  const auto qd = q.dimensions();
  const auto kd = kv.dimensions();
  const auto td = tables.dimensions();
  const int64_t num_seq_rows = static_cast<int64_t>(seq_lens.element_count());
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || td[0] != num_seq_rows ||
      query_start_loc.element_count() != static_cast<size_t>(num_seq_rows + 1) ||
      num_seqs.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "jaxkv paged attention: q [T, Hq, D], kv [N, 2, Hkv, bs, D'], seq_lens [S], "
        "query_start_loc [S + 1], tables [S, B], num_seqs [] expected");
  }
  Work work;  // ParallelFor returns when every part is done: it can live here
  Problem& p = work.p;
  p.q_heads = static_cast<int>(qd[1]);
  p.head_size = static_cast<int>(qd[2]);
  p.num_blocks = kd[0];
  p.kv_heads = static_cast<int>(kd[2]);
  p.block_size = static_cast<int>(kd[3]);
  p.width = td[1];
  p.storage = storage;
  p.itemsize = storage == kF32 ? 4 : 2;
  const ffi::DataType et = kv.element_type();
  const int64_t row = kd[4] * static_cast<int64_t>(ffi::ByteWidth(et));   // bytes per key
  const bool type_ok = et == ffi::DataType::U8 || (et == ffi::DataType::F32 && storage == kF32) ||
                       (et == ffi::DataType::BF16 && storage == kBF16) ||
                       (et == ffi::DataType::F16 && storage == kF16);
  if (!type_ok || storage < kF32 || storage > kF16 || kd[1] != 2 || p.kv_heads <= 0 ||
      p.q_heads % p.kv_heads != 0 || p.q_heads / p.kv_heads > kMaxGroup ||
      p.head_size > kMaxHeadSize || p.block_size <= 0 || p.block_size > kMaxBlockSize ||
      p.width <= 0 || sliding_window < 0 || row != static_cast<int64_t>(p.head_size) * p.itemsize) {
    return ffi::Error::InvalidArgument("jaxkv paged attention: unsupported cache dtype or shape");
  }
  p.q = q.typed_data();
  p.kv = static_cast<const uint8_t*>(kv.untyped_data());
  p.tables = tables.typed_data();
  p.out = out->typed_data();
  p.window = sliding_window;
  p.scale = scale;
  p.soft_cap = soft_cap;

  // Items: sequence rows < num_seqs, their query rows clamped into [0, T) and in order; rows
  // no item covers (padding) are zeroed.
  const int64_t num_tokens = qd[0];
  const int64_t row_floats = static_cast<int64_t>(p.q_heads) * p.head_size;
  const int32_t* qsl = query_start_loc.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int64_t n_seq = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, num_seq_rows);
  int64_t covered = 0;   // rows [0, covered) belong to items
  work.cost.push_back(0);
  for (int64_t s = 0; s < n_seq; ++s) {
    const int64_t r0 = std::clamp<int64_t>(qsl[s], covered, num_tokens);
    const int64_t r1 = std::clamp<int64_t>(qsl[s + 1], r0, num_tokens);
    std::fill(p.out + covered * row_floats, p.out + r0 * row_floats, 0.0f);
    const int64_t first_pos = static_cast<int64_t>(lens[s]) - (qsl[s + 1] - qsl[s]) + (r0 - qsl[s]);
    for (int64_t r = r0; r < r1; r += kTileRows) {   // a decode row, or tiles of a chunk
      const int nq = static_cast<int>(std::min<int64_t>(kTileRows, r1 - r));
      // Rows at negative positions (seq_lens < q_len, bad input) find no keys and give zeros.
      const int64_t pos0 = first_pos + (r - r0);
      for (int h = 0; h < p.kv_heads; ++h) {
        work.items.push_back(Item{static_cast<int32_t>(s), static_cast<int32_t>(r), nq,
                                   static_cast<int32_t>(pos0), h});
        const int64_t keys = std::min<int64_t>(pos0 + nq, p.width * p.block_size) -
                             key_lo(p, static_cast<int>(pos0));
        work.cost.push_back(work.cost.back() + 8 + std::max<int64_t>(keys, 0) * nq);
      }
    }
    covered = r1;
  }
  std::fill(p.out + covered * row_floats, p.out + num_tokens * row_floats, 0.0f);
  const int64_t n = static_cast<int64_t>(work.items.size());
  if (n == 0) return ffi::Error::Success();

  // ~512 key-rows per part at least (the helpers are awake during a step: a decode row's few
  // KV heads are worth splitting), up to 4 parts per thread so that uneven parts even out.
  const int threads = jaxkv_cpu::Threads(pool, num_threads);
  work.parts = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({n, 4 * threads, work.cost[n] / 512})));
  // The Helpers only when a matmul kernel woke them (Team::kHelpersIfAwake).
  jaxkv_cpu::ParallelFor(
      pool, threads, work.parts, [&work](int w) { work.run_part(w); },
      jaxkv_cpu::Team::kHelpersIfAwake);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // cache pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables [S, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hq, D]
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("storage")
                                  .Attr<int32_t>("num_threads"));

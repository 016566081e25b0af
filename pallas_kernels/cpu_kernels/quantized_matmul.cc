// Weight-only quantized matmul for the CPU: an XLA FFI custom call that reads the int8 / fp8
// kernel as stored.
//
// y [M, N] f32 = x [M, K] f32 @ (q [K, N] * scale), q int8 or float8_e4m3fn (as its bytes),
// scale [N] (one per output column; block = 0) or [K / block, N] (one per block of `block`
// inputs and column, GGUF Q8_0's layout with block 32), f32 or f16 (Q8_0's, read as stored).
// With out_major, q is [N, K] and block scales [N, K / block] (the LM head's vocabulary-major
// layout): y = x @ (q * s)^T. Float weights (bf16, f32) go the same way without scales (an
// empty scale [0]): y = x @ q, each bf16 widened in registers (XLA:CPU's bf16 dot at a decode
// step's few rows converts the whole kernel to f32 first, measured 3.7 GB/s).
//
// Why it exists: XLA:CPU does not fuse the int8 -> f32 convert into its dot, so a weight-only
// quantized linear first writes the whole kernel as f32 (4 bytes a parameter) and then reads it
// again: a decode step moves more bytes than with f32 weights. Here each weight byte is read
// once and widened in registers, for the few rows of a decode step (the caller routes larger
// row counts to XLA's GEMM).
//
// Input-major work: the inputs (rows of q) split into contiguous ranges, one per thread, so
// each thread streams one contiguous run of memory (the hardware prefetcher keeps up; a split
// by columns has every thread jump between rows, measured 2-3x slower on SmolLM2's 576-wide
// kernels); each range's partial sums of all columns go to their own buffer, added up at the
// end. Within a range, 8 rows of q at a time are widened in registers (16 columns at a time)
// and multiply-added into every row of x's partial sums, so a partial sum is loaded and stored
// once per 8 multiply-adds; per-block scales multiply a block's sums as the block ends. Columns
// go in chunks whose partial sums stay in the L1 / L2 caches (all of them for one row of x).
// Out-major work: outputs split over the threads (each output's K weights are contiguous);
// per output, 16 lanes of partial sums per row of x, reduced once.
//
// The widening uses x86's byte -> int32 instructions where the build has AVX2 or AVX-512
// (GCC 12 auto-vectorizes int8 -> float poorly: measured half the speed), else portable vector
// extensions.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv_cpu::ForGroups;
using jaxkv_cpu::Floats;
using jaxkv_cpu::kLanes;
using jaxkv_cpu::Load;
using jaxkv_cpu::Store;
using jaxkv_cpu::VFloats;
using jaxkv_cpu::VInts;
using jaxkv_cpu::VShorts;
using jaxkv_cpu::VUInts;

constexpr int64_t kAccFloats = 16384;  // rows x columns of a chunk's partial sums (64 KiB)
constexpr int64_t kMaxRows = 64;       // rows of x the kernel accepts
constexpr int64_t kRowsPerPass = 8;    // rows of q widened together
constexpr int64_t kMinWork = 32768;    // weights a part gets at least
constexpr int64_t kPrefetchOutputs = 4;  // out-major: outputs read ahead
constexpr int32_t kInt8 = 0, kFp8 = 1, kBf16 = 2, kF32 = 3;

// The stored element of each kernel type: a byte (int8, float8_e4m3fn), bfloat16's bits, float.
template <int32_t QT>
using Elem = std::conditional_t<QT == kBf16, uint16_t, std::conditional_t<QT == kF32, float, uint8_t>>;
// Elements of one 64-byte cache line.
template <int32_t QT>
constexpr int64_t kLineElems = 64 / sizeof(Elem<QT>);
// Whether a kernel type has scales (int8, fp8); float weights (bf16, f32) have none.
template <int32_t QT>
constexpr bool kScaled = QT == kInt8 || QT == kFp8;

// float8_e4m3fn bits -> float: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
// 0x7f / 0xff are NaN. A normal number moves its exponent and mantissa into a float's fields
// and rebiases the exponent (+120); a subnormal (exponent 0) is its mantissa times 2^-9,
// computed as a float product (no float subnormal is formed, so flush-to-zero modes change
// nothing).
inline float Fp8ToFloat(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const float normal = __builtin_bit_cast(float, (mag << 20) + (120u << 23));
  const float subnormal = static_cast<float>(mag) * (1.0f / 512.0f);
  const float v = (mag >> 3) == 0 ? subnormal : normal;
  const float nan = __builtin_nanf("");
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, mag == 0x7fu ? nan : v) | sign);
}

template <int32_t QT>
inline float Scalar(Elem<QT> b) {
  if constexpr (QT == kInt8) {
    return static_cast<float>(static_cast<int8_t>(b));
  } else if constexpr (QT == kFp8) {
    return Fp8ToFloat(b);
  } else if constexpr (QT == kBf16) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16);
  } else {
    return b;
  }
}

// The kLanes elements at p widened to floats (int8 values, float8_e4m3fn's as Fp8ToFloat,
// bfloat16's as the top half of a float's bits, floats as they are).
template <int32_t QT>
inline void Widen(const Elem<QT>* p, VFloats& w) {
  if constexpr (QT == kF32) {
    Load(w, p);
  } else if constexpr (QT == kBf16) {
#if defined(__AVX512F__)
    const __m512i u = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    std::memcpy(&w, &u, sizeof(w));
#elif defined(__AVX2__)
    __m256i u[2];
    for (int h = 0; h < 2; ++h) {
      u[h] = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h))), 16);
    }
    std::memcpy(&w, u, sizeof(w));
#else
    VShorts b;
    std::memcpy(&b, p, sizeof(b));
    w = (VFloats)(__builtin_convertvector(b, VUInts) << 16);
#endif
  } else if constexpr (QT == kInt8) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    std::memcpy(&w, &f, sizeof(w));
#elif defined(__AVX2__)
    __m256 f[2];
    for (int h = 0; h < 2; ++h) {
      f[h] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
    }
    std::memcpy(&w, f, sizeof(w));
#else  // in two steps: GCC widens bytes to int32 in one step byte by byte
    jaxkv_cpu::VSBytes b;
    std::memcpy(&b, p, sizeof(b));
    w = __builtin_convertvector(
        __builtin_convertvector(__builtin_convertvector(b, jaxkv_cpu::VSShorts), VInts), VFloats);
#endif
  } else {
    VUInts v;
#if defined(__AVX512F__)
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &u, sizeof(v));
#elif defined(__AVX2__)
    __m256i u[2];
    for (int h = 0; h < 2; ++h) {
      u[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    }
    std::memcpy(&v, u, sizeof(v));
#else
    jaxkv_cpu::VBytes b;
    std::memcpy(&b, p, sizeof(b));
    v = __builtin_convertvector(__builtin_convertvector(b, jaxkv_cpu::VShorts), VUInts);
#endif
    // Fp8ToFloat on every lane, selects as masks (a comparison gives all-ones lanes).
    const VUInts mag = v & 0x7fu;
    const VUInts sign = (v & 0x80u) << 24;
    const VUInts normal = (mag << 20) + (120u << 23);
    const VFloats sub_f = __builtin_convertvector((VInts)mag, VFloats) * (1.0f / 512.0f);
    const VUInts sub = (VUInts)sub_f;
    const VUInts is_sub = (VUInts)((mag >> 3) == 0u);
    const VUInts is_nan = (VUInts)(mag == 0x7fu);
    VUInts bits = (sub & is_sub) | (normal & ~is_sub);
    bits = (0x7fc00000u & is_nan) | (bits & ~is_nan);
    w = (VFloats)(bits | sign);
  }
}

struct Problem {
  const float* x;    // [M, K]
  const void* q;  // [K, N] (input-major), or [N, K] when out_major; Elem<qtype>
  jaxkv_cpu::Params s;  // [N] or [K / block, N]; [N] or [N, K / block] when out_major
  int64_t m, k, n, block;

  template <int32_t QT>
  const Elem<QT>* weights() const {
    return static_cast<const Elem<QT>*>(q);
  }
};

// d_i[j] += sum_{t < T} x_i[t] q_t[j] for R rows of x (d_i = d + i * ds, x_i = x + i * xs) and
// T rows of q (q_t = q + t * qs), j < nc: each weight widened once for all R rows.
template <int32_t QT, int R, int T>
void AccumulateRows(float* __restrict__ d, int64_t ds, const Elem<QT>* __restrict__ q, int64_t qs,
                    const float* __restrict__ x, int64_t xs, int64_t nc) {
  float xv[R][T];
  for (int i = 0; i < R; ++i) {
    for (int t = 0; t < T; ++t) xv[i][t] = x[i * xs + t];
  }
  int64_t j = 0;
  for (; j + kLanes <= nc; j += kLanes) {
    if (T > 1 && j % kLineElems<QT> == 0) {  // the next pass's rows, one cache line each
      for (int t = 0; t < T; ++t) __builtin_prefetch(q + (T + t) * qs + j);
    }
    VFloats w[T];
    for (int t = 0; t < T; ++t) Widen<QT>(q + t * qs + j, w[t]);
    for (int i = 0; i < R; ++i) {
      VFloats di;
      Load(di, d + i * ds + j);
      for (int t = 0; t < T; ++t) di += xv[i][t] * w[t];
      Store(d + i * ds + j, di);
    }
  }
  for (; j < nc; ++j) {
    float w[T];
    for (int t = 0; t < T; ++t) w[t] = Scalar<QT>(q[t * qs + j]);
    for (int i = 0; i < R; ++i) {
      float total = d[i * ds + j];
      for (int t = 0; t < T; ++t) total += xv[i][t] * w[t];
      d[i * ds + j] = total;
    }
  }
}

// dst [m, nc] += x[:, k0 : k1] @ q[k0 : k1, c0 : c0 + nc] (unscaled).
template <int32_t QT>
void AccumulateRange(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t nc,
                     float* __restrict__ dst) {
  int64_t kk = k0;
  for (; kk + kRowsPerPass <= k1; kk += kRowsPerPass) {
    const Elem<QT>* q = p.weights<QT>() + kk * p.n + c0;
    ForGroups(p.m, [&](auto rows, int64_t i) {
      AccumulateRows<QT, decltype(rows)::value, kRowsPerPass>(dst + i * nc, nc, q, p.n,
                                                              p.x + i * p.k + kk, p.k, nc);
    });
  }
  for (; kk < k1; ++kk) {
    const Elem<QT>* q = p.weights<QT>() + kk * p.n + c0;
    ForGroups(p.m, [&](auto rows, int64_t i) {
      AccumulateRows<QT, decltype(rows)::value, 1>(dst + i * nc, nc, q, p.n, p.x + i * p.k + kk,
                                                   p.k, nc);
    });
  }
}

// out [m, N] (row stride N), columns [c0, c1) = x[:, k0 : k1] @ (q * s)[k0 : k1, c0 : c1]
// (unscaled per output column: block 0). Scratch: acc and part, m * chunk floats each, sbuf
// chunk floats (a block's f16 scales as floats).
template <int32_t QT>
void InputMajorTask(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t c1,
                    int64_t chunk, float* __restrict__ out, float* __restrict__ acc,
                    float* __restrict__ part, float* __restrict__ sbuf) {
  for (int64_t cc = c0; cc < c1; cc += chunk) {
    const int64_t nc = std::min(chunk, c1 - cc);
    std::fill(acc, acc + p.m * nc, 0.0f);
    if (p.block == 0) {
      AccumulateRange<QT>(p, k0, k1, cc, nc, acc);
    } else {
      for (int64_t g0 = k0; g0 < k1; g0 += p.block) {
        std::fill(part, part + p.m * nc, 0.0f);
        AccumulateRange<QT>(p, g0, g0 + p.block, cc, nc, part);
        const float* __restrict__ s = Floats(p.s, (g0 / p.block) * p.n + cc, nc, sbuf);
        for (int64_t i = 0; i < p.m; ++i) {
          float* __restrict__ a = acc + i * nc;
          const float* __restrict__ pi = part + i * nc;
#pragma omp simd
          for (int64_t j = 0; j < nc; ++j) a[j] += pi[j] * s[j];
        }
      }
    }
    for (int64_t i = 0; i < p.m; ++i) std::memcpy(out + i * p.n + cc, acc + i * nc, nc * 4);
  }
}

// acc[i] += x_i[j0 : j1] * row[j0 : j1] lane by lane for R rows of x (x_i = x + i * x_stride),
// j1 - j0 a multiple of kLanes: each weight widened once for all rows.
template <int32_t QT, int R>
inline void DotLanes(const Elem<QT>* __restrict__ row, const float* __restrict__ x,
                     int64_t x_stride, int64_t j0, int64_t j1, VFloats* __restrict__ acc) {
  for (int64_t j = j0; j < j1; j += kLanes) {
    VFloats w;
    Widen<QT>(row + j, w);
    for (int i = 0; i < R; ++i) {
      VFloats xi;
      Load(xi, x + i * x_stride + j);
      acc[i] += xi * w;
    }
  }
}

// y[i0 + i, n] for R rows of x and the out-major output n (its K weights contiguous): 16 lanes
// of partial sums per row, the block's scale applied as each block ends (block a multiple of
// kLanes, or 0: per output, scaled once at the end). s: the output's scales as floats.
template <int32_t QT, int R>
void OutputDot(const Problem& p, int64_t i0, int64_t n, const float* __restrict__ s,
               float* __restrict__ y) {
  const Elem<QT>* __restrict__ row = p.weights<QT>() + n * p.k;
  const float* __restrict__ x = p.x + i0 * p.k;
  VFloats lanes[R] = {};
  if (p.block == 0) {
    DotLanes<QT, R>(row, x, p.k, 0, p.k, lanes);
  } else {
    for (int64_t g = 0; g < p.k / p.block; ++g) {
      VFloats part[R] = {};
      DotLanes<QT, R>(row, x, p.k, g * p.block, (g + 1) * p.block, part);
      for (int i = 0; i < R; ++i) lanes[i] += s[g] * part[i];
    }
  }
  const float scale = p.block == 0 && kScaled<QT> ? s[0] : 1.0f;
  for (int i = 0; i < R; ++i) {
    float total = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) total += lanes[i][j];
    y[(i0 + i) * p.n + n] = total * scale;
  }
}

// y[i, n] for every row i of x, an out-major output whose block (or K, per output) is not a
// multiple of kLanes: one weight at a time.
template <int32_t QT>
void OutputDotScalar(const Problem& p, int64_t n, const float* __restrict__ s,
                     float* __restrict__ y) {
  const int64_t group = p.block > 0 ? p.block : p.k;
  const int64_t groups = p.k / group;
  const Elem<QT>* __restrict__ row = p.weights<QT>() + n * p.k;
  for (int64_t i = 0; i < p.m; ++i) {
    const float* __restrict__ xi = p.x + i * p.k;
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.0f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) dot += xi[j] * Scalar<QT>(row[j]);
      total += p.block > 0 ? dot * s[g] : dot;
    }
    y[i * p.n + n] = p.block > 0 || !kScaled<QT> ? total : total * s[0];
  }
}

// Outputs [n0, n1). Scratch: sbuf, K / block floats (an output's f16 scales as floats).
template <int32_t QT>
void OutputRange(const Problem& p, int64_t n0, int64_t n1, float* __restrict__ sbuf,
                 float* __restrict__ y) {
  const bool vector = (p.block > 0 ? p.block : p.k) % kLanes == 0;
  const int64_t groups = p.block > 0 ? p.k / p.block : 1;
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kPrefetchOutputs < n1) {  // an output a few ahead, one cache line at a time
      const Elem<QT>* ahead = p.weights<QT>() + (n + kPrefetchOutputs) * p.k;
      for (int64_t c = 0; c < p.k; c += kLineElems<QT>) __builtin_prefetch(ahead + c);
    }
    const float* s = kScaled<QT> ? Floats(p.s, n * groups, groups, sbuf) : nullptr;
    if (!vector) {
      OutputDotScalar<QT>(p, n, s, y);
      continue;
    }
    ForGroups(p.m, [&](auto rows, int64_t i) {
      OutputDot<QT, decltype(rows)::value>(p, i, n, s, y);
    });
  }
}

// Scratch floats of the calling thread, kept between calls (a fresh allocation of this size
// would map and fault in new pages on every call); one buffer per Slot.
template <int Slot>
float* ThreadScratch(int64_t floats) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
  return scratch.data();
}

template <int32_t QT>
void Run(ffi::ThreadPool& pool, int threads, const Problem& p, bool out_major, float* y) {
  const int want = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, p.k * p.n / kMinWork)));
  if (out_major) {
    const int parts = static_cast<int>(std::min<int64_t>(want, p.n));
    jaxkv_cpu::ParallelFor(pool, threads, parts, [&](int w) {
      float* sbuf = ThreadScratch<1>(p.block > 0 ? p.k / p.block : 1);
      OutputRange<QT>(p, p.n * w / parts, p.n * (w + 1) / parts, sbuf, y);
    });
    return;
  }
  // Input ranges (whole blocks; rows of kRowsPerPass per output column) x column ranges.
  const int64_t unit = p.block > 0 ? p.block : kRowsPerPass;
  const int64_t units = (p.k + unit - 1) / unit;
  const int kparts = static_cast<int>(std::min<int64_t>(want, units));
  const int cparts = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((want + kparts - 1) / kparts, p.n / 64)));
  const int64_t chunk =
      std::max<int64_t>(kLanes, kAccFloats / p.m / kLanes * kLanes);
  // Range 0 writes y; range r > 0 its own [m, N] buffer, added to y at the end.
  float* partials = kparts > 1 ? ThreadScratch<0>((kparts - 1) * p.m * p.n) : nullptr;
  jaxkv_cpu::ParallelFor(pool, threads, kparts * cparts, [&](int w) {
    const int kp = w / cparts, cp = w % cparts;
    const int64_t k0 = std::min(p.k, units * kp / kparts * unit);
    const int64_t k1 = std::min(p.k, units * (kp + 1) / kparts * unit);
    const int64_t c0 = p.n * cp / cparts / kLanes * kLanes;
    const int64_t c1 = cp + 1 == cparts ? p.n : p.n * (cp + 1) / cparts / kLanes * kLanes;
    const int64_t width = std::min(chunk, c1 - c0);
    float* scratch = ThreadScratch<1>((2 * p.m + 1) * width);
    float* out = kp == 0 ? y : partials + (kp - 1) * p.m * p.n;
    InputMajorTask<QT>(p, k0, k1, c0, c1, width, out, scratch, scratch + p.m * width,
                       scratch + 2 * p.m * width);
  });
  const bool column_scales = p.block == 0 && kScaled<QT>;
  if (kparts > 1 || column_scales) {
    const float* __restrict__ s =
        column_scales ? Floats(p.s, 0, p.n, ThreadScratch<1>(p.n)) : nullptr;
    for (int64_t i = 0; i < p.m; ++i) {
      float* __restrict__ yi = y + i * p.n;
      for (int r = 1; r < kparts; ++r) {
        const float* __restrict__ src = partials + ((r - 1) * p.m + i) * p.n;
#pragma omp simd
        for (int64_t j = 0; j < p.n; ++j) yi[j] += src[j];
      }
      if (column_scales) {
#pragma omp simd
        for (int64_t j = 0; j < p.n; ++j) yi[j] *= s[j];
      }
    }
  }
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                               ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> y,
                               int64_t block, int32_t qtype, bool out_major, int32_t num_threads) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  const bool ranks_ok = xd.size() == 2 && qd.size() == 2;
  const int64_t k = ranks_ok ? qd[out_major ? 1 : 0] : 0;
  const int64_t n = ranks_ok ? qd[out_major ? 0 : 1] : 0;
  const bool scaled = qtype == kInt8 || qtype == kFp8;
  const bool type_ok =
      scaled ? ffi::ByteWidth(q.element_type()) == 1
             : (qtype == kBf16 && q.element_type() == ffi::DataType::BF16) ||
                   (qtype == kF32 && q.element_type() == ffi::DataType::F32);
  const bool scale_ok =
      !scaled ? block == 0 && sd.size() == 1 && sd[0] == 0
              : ((block == 0 && sd.size() == 1 && sd[0] == n) ||
                 (block > 0 && k % block == 0 && sd.size() == 2 &&
                  sd[out_major ? 1 : 0] == k / block && sd[out_major ? 0 : 1] == n));
  if (!ranks_ok || xd[1] != k || xd[0] > kMaxRows || !type_ok || !scale_ok ||
      (scale.element_type() != ffi::DataType::F32 && scale.element_type() != ffi::DataType::F16)) {
    return ffi::Error::InvalidArgument(
        "jaxkv quantized matmul: x [M <= 64, K] f32, q [K, N] (or [N, K] out-major) int8 / "
        "fp8 with scale [N] (block 0) or [K / block, N] (or [N, K / block]) f32 or f16, or "
        "q bf16 / f32 with an empty scale [0] expected");
  }
  const Problem p{x.typed_data(), q.untyped_data(),
                  jaxkv_cpu::Params{scale.untyped_data(),
                                    scale.element_type() == ffi::DataType::F16},
                  xd[0], k, n, block};
  float* out = y->typed_data();
  if (p.m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // no inputs: y = 0
    std::fill(out, out + p.m * n, 0.0f);
    return ffi::Error::Success();
  }
  const int threads = jaxkv_cpu::Threads(pool, num_threads);
  switch (qtype) {
    case kInt8:
      Run<kInt8>(pool, threads, p, out_major, out);
      break;
    case kFp8:
      Run<kFp8>(pool, threads, p, out_major, out);
      break;
    case kBf16:
      Run<kBf16>(pool, threads, p, out_major, out);
      break;
    default:
      Run<kF32>(pool, threads, p, out_major, out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantizedMatmulCpu, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // q [K, N] | [N, K] int8 | fp8 | bf16 | f32
                                  .Arg<ffi::AnyBuffer>()  // scale [N] | [K/b, N] | [N, K/b] | [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("block")
                                  .Attr<int32_t>("qtype")
                                  .Attr<bool>("out_major")
                                  .Attr<int32_t>("num_threads"));

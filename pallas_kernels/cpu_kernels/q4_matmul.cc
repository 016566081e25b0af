// Weight-only 4-bit matmul for the CPU: an XLA FFI custom call that reads the packed nibbles as
// stored, half a byte per weight.
//
// y [M, N] f32 = x [M, K] f32 @ w, w [K, N] = q * scale + offset per block of 32 inputs (GGUF
// Q4_0 / Q4_1 / Q4_K's form after repacking): q in 0..15, packed [K / 2, N] uint8 where, for
// block b, byte packed[16 b + j, n] holds q[32 b + j, n] in its low nibble and
// q[32 b + 16 + j, n] in its high one (j in 0..15); scale and offset [K / 32, N], f32 or f16
// (each on its own). With out_major, packed [N, K / 2] (byte packed[n, 16 b + j] holds
// q[n, 32 b + j] low, q[n, 32 b + 16 + j] high), scale and offset [N, K / 32] (the LM head's
// vocabulary-major layout, GGUF's own): y = x @ w^T.
//
// Why it exists: XLA:CPU does not fuse the unpacking and the per-block scale into its dot, so
// a 4-bit linear first writes the whole kernel as floats and reads it again: a decode step
// moves 8 bytes a weight instead of half a byte. Here each weight byte is read once and
// widened in registers, for the few rows of a decode step (the caller routes larger row counts
// to XLA). f16 scales are read as stored for the same reason: converting them to f32 before
// the call would write and read again a quarter of the bytes of the nibbles.
//
// Arithmetic: per block, the nibbles are widened to floats once for up to kGroup rows of x and
// summed without scale, acc = sum_j x[32 b + j] lo_j + x[32 b + 16 + j] hi_j; the block's sum
// enters y as acc * scale + xsum * offset, xsum the block's sum of x (computed once per call).
// Per weight: a widening shared by the group, one multiply-add per row of x.
//
// Work (kernel_common.h's helper threads), as in quantized_matmul.cc: input-major, ranges of
// the input blocks, one per thread, so each thread streams contiguous memory (partial sums
// added at the end); within a range, 4 packed rows (8 inputs) at a time into every row's
// partial sums, so each partial sum is loaded and stored once per 8 multiply-adds, the next 4
// rows prefetched. Out-major: ranges of outputs; per output, its K / 2 bytes a block at a
// time, 16 lanes of partial sums per row of x, reduced once per output.
//
// The widening is written with vectors of 16 lanes (GCC / Clang vector extensions) and x86's
// byte -> int32 widening (vpmovzxbd) where the build has AVX2 or AVX-512, f16 scales with
// F16C's conversion: left to the auto-vectorizer, GCC 12 widens a 16-byte vector to int32 byte
// by byte, takes a 16-iteration block loop in 16-byte vectors, and converts f16 with the
// integer steps of HalfToFloat, each a large share of a decode step's time here. Other
// machines take the portable vector code.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv_cpu::ForGroups;
constexpr int64_t kBlock = 32;         // inputs per block (one scale and offset)
constexpr int64_t kHalf = kBlock / 2;  // packed bytes (rows, input-major) per block
constexpr int64_t kMinCols = 64;       // narrowest column range
constexpr int64_t kMaxCols = 4096;     // widest column range
constexpr int64_t kAccFloats = 16384;  // rows x columns of a range's partial sums (64 KiB)
constexpr int64_t kMaxRows = 64;       // rows of x the kernel accepts
constexpr int64_t kPacked = 4;         // packed rows (8 inputs) per accumulation pass

using jaxkv_cpu::Load;
using jaxkv_cpu::Store;
using jaxkv_cpu::VBytes;
using jaxkv_cpu::VFloats;
using jaxkv_cpu::VInts;
using jaxkv_cpu::VShorts;
static_assert(jaxkv_cpu::kLanes == kHalf, "one vector: the 16 bytes of a block");

// The 16 bytes at p as floats: lo[j] = p[j] & 15, hi[j] = p[j] >> 4.
inline void Nibbles(const uint8_t* p, VFloats& lo, VFloats& hi) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 l = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  const __m512 h = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
#elif defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi32(15);
  __m256 l[2], h[2];
  for (int half = 0; half < 2; ++half) {
    const __m256i q =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
    l[half] = _mm256_cvtepi32_ps(_mm256_and_si256(q, mask));
    h[half] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
  }
  std::memcpy(&lo, l, sizeof(lo));
  std::memcpy(&hi, h, sizeof(hi));
#else  // in two steps: GCC widens bytes to int32 in one step byte by byte
  VBytes b;
  std::memcpy(&b, p, kHalf);
  const VInts q = __builtin_convertvector(__builtin_convertvector(b, VShorts), VInts);
  lo = __builtin_convertvector(q & 15, VFloats);
  hi = __builtin_convertvector(q >> 4, VFloats);
#endif
}

using jaxkv_cpu::Floats;
using jaxkv_cpu::Params;

struct Problem {
  const float* x;       // [M, K]
  const uint8_t* q;     // [K / 2, N] (input-major), or [N, K / 2] when out_major
  Params s, o;          // scale, offset: [K / 32, N], or [N, K / 32] when out_major
  const float* xsum;    // [M, K / 32]: sum of x over each block
  float* y;             // [M, N]
  int64_t m, k, n, nb;  // nb = K / 32 blocks
  bool out_major;
};

inline float Low(uint8_t b) { return static_cast<float>(b & 15u); }
inline float High(uint8_t b) { return static_cast<float>(b >> 4); }

// d_i += sum_t xl_i[t] low(r_t) + xh_i[t] high(r_t) over n columns, t < 4, for R rows of x
// (d_i = d + i * d_stride, xl_i = x + i * x_stride, xh_i = xl_i + 16): eight inputs against
// four packed rows, each nibble widened once for all R rows; 16 columns at a time, the last
// n % 16 one by one.
template <int R>
void Accumulate4Q4(float* __restrict__ d, int64_t d_stride, const uint8_t* __restrict__ r0,
                   const uint8_t* __restrict__ r1, const uint8_t* __restrict__ r2,
                   const uint8_t* __restrict__ r3, const float* __restrict__ x, int64_t x_stride,
                   int64_t n) {
  float l[R][kPacked], h[R][kPacked];
  for (int i = 0; i < R; ++i) {
    for (int t = 0; t < kPacked; ++t) {
      l[i][t] = x[i * x_stride + t];
      h[i][t] = x[i * x_stride + kHalf + t];
    }
  }
  const int64_t stride = r1 - r0;  // packed rows apart
  int64_t j = 0;
  for (; j + kHalf <= n; j += kHalf) {
    if (j % 64 == 0) {  // the next pass's packed rows, one cache line each
      for (int t = 0; t < kPacked; ++t) __builtin_prefetch(r0 + (kPacked + t) * stride + j);
    }
    VFloats lo[kPacked], hi[kPacked];
    Nibbles(r0 + j, lo[0], hi[0]);
    Nibbles(r1 + j, lo[1], hi[1]);
    Nibbles(r2 + j, lo[2], hi[2]);
    Nibbles(r3 + j, lo[3], hi[3]);
    for (int i = 0; i < R; ++i) {
      VFloats di;
      Load(di, d + i * d_stride + j);
      di += l[i][0] * lo[0] + h[i][0] * hi[0] + l[i][1] * lo[1] + h[i][1] * hi[1] +
            l[i][2] * lo[2] + h[i][2] * hi[2] + l[i][3] * lo[3] + h[i][3] * hi[3];
      Store(d + i * d_stride + j, di);
    }
  }
  for (; j < n; ++j) {
    const float lo0 = Low(r0[j]), lo1 = Low(r1[j]), lo2 = Low(r2[j]), lo3 = Low(r3[j]);
    const float hi0 = High(r0[j]), hi1 = High(r1[j]), hi2 = High(r2[j]), hi3 = High(r3[j]);
    for (int i = 0; i < R; ++i) {
      d[i * d_stride + j] += l[i][0] * lo0 + h[i][0] * hi0 + l[i][1] * lo1 + h[i][1] * hi1 +
                             l[i][2] * lo2 + h[i][2] * hi2 + l[i][3] * lo3 + h[i][3] * hi3;
    }
  }
}

// Columns [n0, n0 + nc) of out [M, N] (y, or a partial sum's buffer) over the blocks [b0, b1)
// of the inputs, input-major. Scratch: acc and part m * nc floats, sbuf and obuf nc each (the
// block's f16 scales and offsets as floats).
void RunColumns(const Problem& p, int64_t b0, int64_t b1, int64_t n0, int64_t nc,
                float* __restrict__ out, float* __restrict__ acc, float* __restrict__ part,
                float* __restrict__ sbuf, float* __restrict__ obuf) {
  std::fill(acc, acc + p.m * nc, 0.0f);
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(part, part + p.m * nc, 0.0f);
    const uint8_t* rows = p.q + b * kHalf * p.n + n0;  // packed row 16 b, this range
    for (int64_t j = 0; j < kHalf; j += kPacked) {
      const uint8_t *r0 = rows + j * p.n, *r1 = r0 + p.n, *r2 = r1 + p.n, *r3 = r2 + p.n;
      const float* xb = p.x + b * kBlock + j;
      ForGroups(p.m, [&](auto rows, int64_t i) {
        const float* xi = xb + i * p.k;
        Accumulate4Q4<decltype(rows)::value>(part + i * nc, nc, r0, r1, r2, r3, xi, p.k, nc);
      });
    }
    const float* __restrict__ s = Floats(p.s, b * p.n + n0, nc, sbuf);
    const float* __restrict__ o = Floats(p.o, b * p.n + n0, nc, obuf);
    for (int64_t i = 0; i < p.m; ++i) {
      float* __restrict__ a = acc + i * nc;
      const float* __restrict__ pi = part + i * nc;
      const float xs = p.xsum[i * p.nb + b];
#pragma omp simd
      for (int64_t j = 0; j < nc; ++j) a[j] += pi[j] * s[j] + xs * o[j];
    }
  }
  for (int64_t i = 0; i < p.m; ++i) std::memcpy(out + i * p.n + n0, acc + i * nc, nc * 4);
}

// lanes[i] += scale * (x_lo lo + x_hi hi) for R rows of x over one block of an out-major
// output: its 16 bytes widened once for all rows (x: the block's first input of row 0).
template <int R>
inline void Block(const uint8_t* __restrict__ bytes, float scale, const float* __restrict__ x,
                  int64_t x_stride, VFloats* __restrict__ lanes) {
  VFloats lo, hi;
  Nibbles(bytes, lo, hi);
  for (int i = 0; i < R; ++i) {
    VFloats xl, xh;
    Load(xl, x + i * x_stride);
    Load(xh, x + i * x_stride + kHalf);
    lanes[i] += scale * (xl * lo + xh * hi);
  }
}

// y[i0 + i, n] for R rows of x and one out-major output: each row's 16 lanes of sum_b scale_b
// (x_lo lo + x_hi hi), in two sets (even and odd blocks: one add chain would wait on the
// multiply-add latency) reduced at the end, plus the offsets' dot with the row's block sums.
template <int R>
void DotsInRegisters(const Problem& p, int64_t i0, const uint8_t* __restrict__ row,
                     const float* __restrict__ s, const float* __restrict__ o, int64_t n) {
  VFloats even[R] = {}, odd[R] = {};
  const float* __restrict__ x = p.x + i0 * p.k;
  int64_t b = 0;
  for (; b + 2 <= p.nb; b += 2) {
    Block<R>(row + b * kHalf, s[b], x + b * kBlock, p.k, even);
    Block<R>(row + (b + 1) * kHalf, s[b + 1], x + (b + 1) * kBlock, p.k, odd);
  }
  if (b < p.nb) Block<R>(row + b * kHalf, s[b], x + b * kBlock, p.k, even);
  for (int i = 0; i < R; ++i) {
    const float* __restrict__ xs = p.xsum + (i0 + i) * p.nb;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < p.nb; ++c) total += xs[c] * o[c];
    const VFloats both = even[i] + odd[i];
    for (int64_t j = 0; j < kHalf; ++j) total += both[j];
    p.y[(i0 + i) * p.n + n] = total;
  }
}

// Outputs [n0, n0 + nc) of y for an out-major q (each output's K / 2 bytes contiguous). Scratch:
// sbuf and obuf nb floats each (the output's f16 scales and offsets as floats).
void RunOutputs(const Problem& p, int64_t n0, int64_t nc, float* __restrict__ sbuf,
                float* __restrict__ obuf) {
  for (int64_t n = n0; n < n0 + nc; ++n) {
    const uint8_t* __restrict__ row = p.q + n * (p.k / 2);
    const float* __restrict__ s = Floats(p.s, n * p.nb, p.nb, sbuf);
    const float* __restrict__ o = Floats(p.o, n * p.nb, p.nb, obuf);
    ForGroups(p.m, [&](auto rows, int64_t i) {
      DotsInRegisters<decltype(rows)::value>(p, i, row, s, o, n);
    });
  }
}

// Parts: kparts ranges of the input blocks (input-major; each thread streams contiguous
// memory, as in quantized_matmul.cc) x cparts ranges of the column chunks. Range 0 of the
// inputs writes y, range r > 0 partials[r - 1] ([M, N] each), added to y at the end.
struct Work {
  Problem p;
  std::vector<float> xsum;  // p.xsum's storage
  std::vector<float> partials;  // [kparts - 1, M, N]
  float* partial = nullptr;     // partials.data()
  int64_t cols = jaxkv_cpu::kLanes;  // columns of a chunk
  int64_t chunks = 0;                // column chunks
  int kparts = 1, cparts = 1;

  void RunPart(int w) const {
    const int64_t params = p.out_major ? p.nb : cols;       // sbuf, obuf floats each
    const int64_t body = p.out_major ? 0 : 2 * p.m * cols;  // acc, part
    std::vector<float> scratch(body + 2 * params);
    float* sbuf = scratch.data() + body;
    float* obuf = sbuf + params;
    const int kp = w / cparts, cp = w % cparts;
    const int64_t b0 = p.nb * kp / kparts, b1 = p.nb * (kp + 1) / kparts;
    float* out = kp == 0 ? p.y : partial + (kp - 1) * p.m * p.n;
    const int64_t c0 = chunks * cp / cparts, c1 = chunks * (cp + 1) / cparts;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * cols, nc = std::min<int64_t>(cols, p.n - n0);
      if (p.out_major) {
        RunOutputs(p, n0, nc, sbuf, obuf);
      } else {
        RunColumns(p, b0, b1, n0, nc, out, scratch.data(), scratch.data() + p.m * cols, sbuf,
                   obuf);
      }
    }
  }
};

bool IsParams(const ffi::AnyBuffer& a) {
  return a.element_type() == ffi::DataType::F32 || a.element_type() == ffi::DataType::F16;
}

ffi::Error Q4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                        ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y,
                        bool out_major, int32_t num_threads) {
  const auto xd = x.dimensions();
  const auto qd = packed.dimensions();
  const auto sd = scale.dimensions();
  const auto od = offset.dimensions();
  const bool ranks_ok = xd.size() == 2 && qd.size() == 2 && sd.size() == 2 && od.size() == 2;
  const int64_t k = ranks_ok ? xd[1] : 0;
  const int64_t n = ranks_ok ? qd[out_major ? 0 : 1] : 0;
  const int64_t nb = k / kBlock;
  const int in_axis = out_major ? 1 : 0, out_axis = 1 - in_axis;
  if (!ranks_ok || xd[0] > kMaxRows || k % kBlock != 0 || qd[in_axis] * 2 != k ||
      sd[in_axis] != nb || sd[out_axis] != n || od[in_axis] != nb || od[out_axis] != n ||
      !IsParams(scale) || !IsParams(offset)) {
    return ffi::Error::InvalidArgument(
        "jaxkv q4 matmul: x [M <= 64, K] f32 (K a multiple of 32), packed [K / 2, N] uint8, "
        "scale and offset [K / 32, N] f32 or f16 (out-major: [N, K / 2], [N, K / 32]) expected");
  }
  Work work;  // ParallelFor returns when every part is done: it can live here
  const int64_t m = xd[0];
  {  // block sums of x, for the offsets
    work.xsum.resize(m * nb);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* __restrict__ xb = x.typed_data() + i * k + b * kBlock;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < kBlock; ++j) total += xb[j];
        work.xsum[i * nb + b] = total;
      }
    }
  }
  work.p = Problem{x.typed_data(),
                    packed.typed_data(),
                    Params{scale.untyped_data(), scale.element_type() == ffi::DataType::F16},
                    Params{offset.untyped_data(), offset.element_type() == ffi::DataType::F16},
                    work.xsum.data(),
                    y->typed_data(),
                    m,
                    k,
                    n,
                    nb,
                    out_major};
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // no inputs: y = 0
    std::fill(y->typed_data(), y->typed_data() + m * n, 0.0f);
    return ffi::Error::Success();
  }
  // About 128k weights (64 KiB of nibbles) a part at least, one part per thread. Out-major:
  // ranges of outputs. Input-major: ranges of the input blocks first (contiguous memory per
  // thread), then of column chunks as wide as the partial sums allow.
  const int threads = jaxkv_cpu::Threads(pool, num_threads);
  const int want = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, k * n / 131072)));
  const int64_t cols = std::clamp<int64_t>(
      out_major ? (n + want - 1) / want : std::min(kAccFloats / m, n), kMinCols, kMaxCols);
  work.cols = (cols + kMinCols - 1) / kMinCols * kMinCols;
  work.chunks = (n + work.cols - 1) / work.cols;
  work.kparts = out_major ? 1 : static_cast<int>(std::min<int64_t>(want, nb));
  work.cparts = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(work.chunks, (want + work.kparts - 1) / work.kparts)));
  if (work.kparts > 1) {
    work.partials.resize((work.kparts - 1) * m * n);
    work.partial = work.partials.data();
  }
  jaxkv_cpu::ParallelFor(pool, threads, work.kparts * work.cparts,
                         [&work](int w) { work.RunPart(w); });
  float* out = y->typed_data();
  for (int r = 1; r < work.kparts; ++r) {
    const float* __restrict__ src = work.partials.data() + (r - 1) * m * n;
#pragma omp simd
    for (int64_t j = 0; j < m * n; ++j) out[j] += src[j];
  }
  return ffi::Error::Success();
}

}  // namespace


XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQ4MatmulCpu, Q4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [K / 2, N] | [N, K / 2]
                                  .Arg<ffi::AnyBuffer>()  // scale [K / 32, N] | [N, K / 32] f32|f16
                                  .Arg<ffi::AnyBuffer>()  // offset, as scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("out_major")
                                  .Attr<int32_t>("num_threads"));

// Weight-only quantized matmul for the CPU: an XLA FFI custom call that reads the int8 / fp8
// kernel as stored.
//
// y [M, N] f32 = x [M, K] f32 @ (q [K, N] * scale), q int8 or float8_e4m3fn (as its bytes),
// scale [N] f32 (one per output column; block = 0) or [K / block, N] f32 (one per block of
// `block` inputs and column, GGUF Q8_0's layout with block 32). With out_major, q is [N, K]
// and block scales [N, K / block] (the LM head's vocabulary-major layout): y = x @ (q * s)^T.
//
// Why it exists: XLA:CPU does not fuse the int8 -> f32 convert into its dot, so a weight-only
// quantized linear first writes the whole kernel as f32 (4 bytes a parameter) and then reads it
// again: a decode step moves more bytes than with f32 weights. Here each weight byte is read
// once and widened in registers, for the few rows of a decode step (the caller routes larger
// row counts to XLA's GEMM).
//
// Work: column ranges split over XLA's intra-op pool; per range, for each input k, the range's
// weights of row k (contiguous bytes, so the hardware prefetcher streams them; narrow ranges
// would put every row on another 4 KiB page and stall on memory latency) are widened once and
// accumulated into every row's partial sums (a per-thread buffer of about 64 KiB); per-block
// scales are applied as each block of inputs ends.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinCols = 64;       // narrowest column range
constexpr int64_t kMaxCols = 4096;     // widest column range
constexpr int64_t kAccFloats = 16384;  // rows x columns of a range's partial sums (64 KiB)
constexpr int64_t kMaxRows = 64;       // rows of x the kernel accepts
constexpr int32_t kInt8 = 0, kFp8 = 1;

// float8_e4m3fn bits -> float: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
// 0x7f / 0xff are NaN. Branch-free integer work, so the loops that call it vectorize: a normal
// number moves its exponent and mantissa into a float's fields and rebiases the exponent
// (+120); a subnormal (exponent 0) is its mantissa times 2^-9, computed as a float product (no
// float subnormal is formed, so flush-to-zero modes change nothing).
inline float Fp8ToFloat(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const float normal = __builtin_bit_cast(float, (mag << 20) + (120u << 23));
  const float subnormal = static_cast<float>(mag) * (1.0f / 512.0f);
  const float v = (mag >> 3) == 0 ? subnormal : normal;
  const float nan = __builtin_nanf("");
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, mag == 0x7fu ? nan : v) | sign);
}

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* q;  // [K, N] (input-major), or [N, K] when out_major
  const float* s;    // [N] or [K / block, N]; [N] or [N, K / block] when out_major
  float* y;          // [M, N]
  int64_t m, k, n, block;
  int32_t qtype;
  bool out_major;
};

// Widens nc weights of one row of q into w.
inline void Widen(const Problem& p, const uint8_t* __restrict__ row, int64_t nc,
                  float* __restrict__ w) {
  if (p.qtype == kInt8) {
    const int8_t* __restrict__ r = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
    for (int64_t j = 0; j < nc; ++j) w[j] = static_cast<float>(r[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < nc; ++j) w[j] = Fp8ToFloat(row[j]);
  }
}

// dst[i] += x[i, k0 : k0 + kRows] . w[0 : kRows] for every row i: kRows inputs at a time, so
// each partial sum is loaded and stored once per kRows multiply-adds.
constexpr int64_t kRows = 4;

// d += x0 w0 + x1 w1 + x2 w2 + x3 w3 over n floats (restrict parameters: GCC vectorizes this
// only when it knows the arrays apart).
inline void Accumulate4(float* __restrict__ d, const float* __restrict__ w0,
                        const float* __restrict__ w1, const float* __restrict__ w2,
                        const float* __restrict__ w3, float x0, float x1, float x2, float x3,
                        int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
}

// d += x0 q0 + x1 q1 + x2 q2 + x3 q3 over n int8 weights, widened in registers: for one or two
// rows of x cheaper than storing the widened rows and reading them back (measured, 4096 x 4096:
// 0.90 against 1.6 ms for one row); from about four rows on, widening once wins.
inline void Accumulate4Int8(float* __restrict__ d, const int8_t* __restrict__ q0,
                            const int8_t* __restrict__ q1, const int8_t* __restrict__ q2,
                            const int8_t* __restrict__ q3, float x0, float x1, float x2, float x3,
                            int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    d[j] += x0 * static_cast<float>(q0[j]) + x1 * static_cast<float>(q1[j]) +
            x2 * static_cast<float>(q2[j]) + x3 * static_cast<float>(q3[j]);
  }
}

// d += x w over n floats.
inline void Accumulate1(float* __restrict__ d, const float* __restrict__ w, float x, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] += x * w[j];
}

// d += a * b over n floats.
inline void AccumulateProduct(float* __restrict__ d, const float* __restrict__ a,
                              const float* __restrict__ b, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] += a[j] * b[j];
}

// Columns [n0, n0 + nc) of y; acc and part hold m * nc floats, w kRows * nc.
void RunColumns(const Problem& p, int64_t n0, int64_t nc, float* __restrict__ acc,
                float* __restrict__ part, float* __restrict__ w) {
  const int64_t group = p.block > 0 ? p.block : p.k;
  std::fill(acc, acc + p.m * nc, 0.0f);
  for (int64_t g0 = 0; g0 < p.k; g0 += group) {
    float* __restrict__ dst = p.block > 0 ? part : acc;
    if (p.block > 0) std::fill(part, part + p.m * nc, 0.0f);
    const int64_t g1 = g0 + group;
    int64_t kk = g0;
    for (; kk + kRows <= g1; kk += kRows) {
      if (p.qtype == kInt8 && p.m <= 2) {  // widened in registers for each row of x
        const int8_t* q0 = reinterpret_cast<const int8_t*>(p.q) + kk * p.n + n0;
        for (int64_t i = 0; i < p.m; ++i) {
          const float* xi = p.x + i * p.k + kk;
          Accumulate4Int8(dst + i * nc, q0, q0 + p.n, q0 + 2 * p.n, q0 + 3 * p.n, xi[0], xi[1],
                          xi[2], xi[3], nc);
        }
        continue;
      }
      for (int64_t r = 0; r < kRows; ++r) Widen(p, p.q + (kk + r) * p.n + n0, nc, w + r * nc);
      for (int64_t i = 0; i < p.m; ++i) {
        const float* xi = p.x + i * p.k + kk;
        Accumulate4(dst + i * nc, w, w + nc, w + 2 * nc, w + 3 * nc, xi[0], xi[1], xi[2], xi[3],
                    nc);
      }
    }
    for (; kk < g1; ++kk) {  // the inputs left over (fewer than kRows)
      Widen(p, p.q + kk * p.n + n0, nc, w);
      for (int64_t i = 0; i < p.m; ++i) Accumulate1(dst + i * nc, w, p.x[i * p.k + kk], nc);
    }
    if (p.block > 0) {
      const float* __restrict__ sg = p.s + (g0 / p.block) * p.n + n0;
      for (int64_t i = 0; i < p.m; ++i) AccumulateProduct(acc + i * nc, part + i * nc, sg, nc);
    }
  }
  for (int64_t i = 0; i < p.m; ++i) {
    float* __restrict__ out = p.y + i * p.n + n0;
    const float* __restrict__ a = acc + i * nc;
    if (p.block > 0) {
      std::memcpy(out, a, nc * sizeof(float));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < nc; ++j) out[j] = a[j] * p.s[n0 + j];
    }
  }
}

// Outputs [n0, n0 + nc) of y for an out-major q (each output's K weights contiguous: the LM
// head's vocabulary rows, GGUF's own layout): per output, its row widened once (w holds K
// floats), then one dot product per row of x, per-block scales applied per block.
void RunOutputs(const Problem& p, int64_t n0, int64_t nc, float* __restrict__ w) {
  const int64_t group = p.block > 0 ? p.block : p.k;
  const int64_t groups = p.k / group;
  for (int64_t n = n0; n < n0 + nc; ++n) {
    Widen(p, p.q + n * p.k, p.k, w);
    for (int64_t i = 0; i < p.m; ++i) {
      const float* __restrict__ xi = p.x + i * p.k;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = g * group; j < (g + 1) * group; ++j) dot += xi[j] * w[j];
        total += p.block > 0 ? dot * p.s[n * groups + g] : dot;
      }
      p.y[i * p.n + n] = p.block > 0 ? total : total * p.s[n];
    }
  }
}

struct Work {
  Problem p;
  int64_t cols = kMinCols;  // columns of a range
  int64_t chunks = 0;       // column ranges
  int parts = 1;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void RunParts() {
    std::vector<float> scratch;  // allocated once this thread has a part
    for (int w; (w = next.fetch_add(1)) < parts;) {
      if (scratch.empty()) scratch.resize(p.out_major ? p.k : (2 * p.m + kRows) * cols);
      float* acc = scratch.data();
      float* part = acc + p.m * cols;
      float* wrow = part + p.m * cols;
      const int64_t c0 = chunks * w / parts, c1 = chunks * (w + 1) / parts;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * cols;
        if (p.out_major) {
          RunOutputs(p, n0, std::min<int64_t>(cols, p.n - n0), acc);
        } else {
          RunColumns(p, n0, std::min<int64_t>(cols, p.n - n0), acc, part, wrow);
        }
      }
      if (done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                               ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                               int64_t block, int32_t qtype, bool out_major, int32_t num_threads) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  const bool ranks_ok = xd.size() == 2 && qd.size() == 2;
  const int64_t k = ranks_ok ? qd[out_major ? 1 : 0] : 0;
  const int64_t n = ranks_ok ? qd[out_major ? 0 : 1] : 0;
  const bool scale_ok =
      (block == 0 && sd.size() == 1 && sd[0] == n) ||
      (block > 0 && k % block == 0 && sd.size() == 2 &&
       sd[out_major ? 1 : 0] == k / block && sd[out_major ? 0 : 1] == n);
  if (!ranks_ok || xd[1] != k || xd[0] > kMaxRows || ffi::ByteWidth(q.element_type()) != 1 ||
      (qtype != kInt8 && qtype != kFp8) || !scale_ok) {
    return ffi::Error::InvalidArgument(
        "jaxkv quantized matmul: x [M <= 64, K] f32, q [K, N] (or [N, K] out-major) of 1-byte "
        "elements, scale [N] (block 0) or [K / block, N] (or [N, K / block]) f32 expected");
  }
  auto work = std::make_shared<Work>();
  work->p = Problem{x.typed_data(), static_cast<const uint8_t*>(q.untyped_data()),
                    scale.typed_data(), y->typed_data(), xd[0], k, n, block, qtype, out_major};
  if (xd[0] == 0 || n == 0) return ffi::Error::Success();
  // XLA's intra-op pool runs the helpers. Ranges: as wide as the partial sums allow, but at
  // least one per thread; about 64k weights a part at least.
  const int64_t pool_threads = pool.num_threads();
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(num_threads, pool_threads > 0 ? pool_threads + 1 : 1)));
  const int64_t per_thread = (n + threads - 1) / threads;
  const int64_t cols = std::clamp<int64_t>(
      out_major ? per_thread : std::min(kAccFloats / xd[0], per_thread), kMinCols, kMaxCols);
  work->cols = (cols + kMinCols - 1) / kMinCols * kMinCols;
  work->chunks = (n + work->cols - 1) / work->cols;
  work->parts = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({work->chunks, static_cast<int64_t>(threads), k * n / 65536})));
  const int helpers = std::min(threads, work->parts) - 1;
  for (int t = 0; t < helpers; ++t) pool.Schedule([work] { work->RunParts(); });
  work->RunParts();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == work->parts; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantizedMatmulCpu, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // q [K, N] | [N, K] int8 | fp8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N] | [K / b, N] | [N, K / b]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("block")
                                  .Attr<int32_t>("qtype")
                                  .Attr<bool>("out_major")
                                  .Attr<int32_t>("num_threads"));

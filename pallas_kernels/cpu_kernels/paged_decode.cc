// Paged decode attention for the CPU, called from XLA as an FFI custom call.
//
// One query row per sequence (the sequence's last row) attends its keys [lo, hi) read page by
// page from the paged cache; heads of one GQA group share each page read. Online softmax per
// page, in f32. Built on first use by pallas_kernels/cpu_backend.py (g++ -O3 -march=native);
// the Python side validates shapes and dtypes, this file re-checks what it relies on.
//
// Why it exists: on XLA:CPU the decode q.k / p.v of small GQA groups run as YNNPACK reductions
// at ~10-20 GFLOP/s and each page is gathered into a buffer first; here each page is read
// once, straight from the cache, and reduced in registers (see benchmarks/RESULTS.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadSize = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxBlockSize = 256;
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

// A page row of n values as f32: the page itself for f32 storage, else widened into `dst`.
inline const float* page_as_f32(const uint8_t* src, int n, int32_t storage, float* dst) {
  if (storage == kF32) return reinterpret_cast<const float*>(src);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  if (storage == kBF16) {
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
  return dst;
}

struct Problem {
  const float* q;          // [S, Hq, D]
  const uint8_t* kv;       // [N, 2, Hkv, bs, D] pages, `storage` elements
  const int32_t* tables;   // [S, B]
  const int32_t* lo;       // [S] first key
  const int32_t* hi;       // [S] end key (exclusive); hi <= lo: no keys, zeros out
  float* out;              // [S, Hq, D]
  int64_t num_blocks, width;
  int q_heads, kv_heads, head_size, block_size, itemsize;
  int32_t storage;
  float scale, soft_cap;   // soft_cap <= 0: none
};

// Row s, KV head h: the G query heads of the group, over every page of the row's keys.
// `pages` holds 2 * bs * D floats (the widened K and V page of 16-bit caches).
void attend(const Problem& p, int64_t s, int h, float* pages) {
  const int group = p.q_heads / p.kv_heads, d_n = p.head_size;
  float* out = p.out + (s * p.q_heads + h * group) * d_n;
  const int lo = std::max(p.lo[s], 0), hi = p.hi[s];
  if (hi <= lo) {
    std::fill(out, out + group * d_n, 0.0f);
    return;
  }
  alignas(64) float q[kMaxGroup][kMaxHeadSize];
  alignas(64) float acc[kMaxGroup][kMaxHeadSize];
  alignas(64) float logit[kMaxBlockSize];
  float* kbuf = pages;
  float* vbuf = pages + static_cast<int64_t>(p.block_size) * d_n;
  float m[kMaxGroup], l[kMaxGroup];
  const float* qs = p.q + (s * p.q_heads + h * group) * d_n;
  for (int g = 0; g < group; ++g) {
    for (int e = 0; e < d_n; ++e) {
      q[g][e] = qs[g * d_n + e] * p.scale;
      acc[g][e] = 0.0f;
    }
    m[g] = kNegInf;
    l[g] = 0.0f;
  }
  const int64_t page_bytes = static_cast<int64_t>(p.block_size) * d_n * p.itemsize;
  const int32_t* table = p.tables + s * p.width;
  for (int b = lo / p.block_size; b * p.block_size < hi; ++b) {
    // Table entries are trusted by the engine; clamping keeps a bad one inside the cache.
    const int64_t blk = std::min<int64_t>(std::max<int32_t>(table[b], 0), p.num_blocks - 1);
    const float* k = page_as_f32(p.kv + ((blk * 2 + 0) * p.kv_heads + h) * page_bytes,
                                 p.block_size * d_n, p.storage, kbuf);
    const float* v = page_as_f32(p.kv + ((blk * 2 + 1) * p.kv_heads + h) * page_bytes,
                                 p.block_size * d_n, p.storage, vbuf);
    const int t0 = std::max(lo - b * p.block_size, 0);
    const int nk = std::min(hi - b * p.block_size, p.block_size) - t0;
    k += t0 * d_n;
    v += t0 * d_n;
    for (int g = 0; g < group; ++g) {
      for (int t = 0; t < nk; ++t) {
        const float* kr = k + t * d_n;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int e = 0; e < d_n; ++e) dot += q[g][e] * kr[e];
        logit[t] = dot;
      }
      if (p.soft_cap > 0.0f) {
        const float cap = p.soft_cap, inv = 1.0f / p.soft_cap;
        for (int t = 0; t < nk; ++t) logit[t] = cap * std::tanh(logit[t] * inv);
      }
      float mx = m[g];
#pragma omp simd reduction(max : mx)
      for (int t = 0; t < nk; ++t) mx = std::max(mx, logit[t]);
      const float corr = m[g] == kNegInf ? 0.0f : exp_nonpositive(m[g] - mx);
      m[g] = mx;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < nk; ++t) {
        logit[t] = exp_nonpositive(logit[t] - mx);
        sum += logit[t];
      }
      l[g] = l[g] * corr + sum;
      float* ag = acc[g];
#pragma omp simd
      for (int e = 0; e < d_n; ++e) ag[e] *= corr;
      for (int t = 0; t < nk; ++t) {
        const float w = logit[t];
        const float* vr = v + t * d_n;
#pragma omp simd
        for (int e = 0; e < d_n; ++e) ag[e] += w * vr[e];
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int e = 0; e < d_n; ++e) out[g * d_n + e] = acc[g][e] * inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                           ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap,
                           int32_t storage, int32_t num_threads) {
  const auto qd = q.dimensions();
  const auto kd = kv.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || td[0] != qd[0] ||
      lo.element_count() != static_cast<size_t>(qd[0]) ||
      hi.element_count() != static_cast<size_t>(qd[0])) {
    return ffi::Error::InvalidArgument("jaxkv paged decode: q [S, Hq, D], kv [N, 2, Hkv, bs, D'], "
                                       "tables [S, B], lo / hi [S] expected");
  }
  Problem p;
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
      p.head_size > kMaxHeadSize || p.block_size > kMaxBlockSize ||
      row != static_cast<int64_t>(p.head_size) * p.itemsize) {
    return ffi::Error::InvalidArgument("jaxkv paged decode: unsupported cache dtype or shape");
  }
  p.q = q.typed_data();
  p.kv = static_cast<const uint8_t*>(kv.untyped_data());
  p.tables = tables.typed_data();
  p.lo = lo.typed_data();
  p.hi = hi.typed_data();
  p.out = out->typed_data();
  p.scale = scale;
  p.soft_cap = soft_cap;

  // Work items (row, KV head) in order, cut into contiguous ranges of about equal key counts.
  const int64_t items = qd[0] * p.kv_heads;
  std::vector<int64_t> cost(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t s = i / p.kv_heads;
    cost[i + 1] = cost[i] + 8 + std::max(0, p.hi[s] - std::max(p.lo[s], 0));
  }
  // A thread costs ~10-20 us to start: only split work worth more than ~4k keys per thread.
  const int64_t by_work = std::max<int64_t>(1, cost[items] / 4096);
  const int threads = static_cast<int>(std::min<int64_t>({std::max(num_threads, 1), by_work, items}));
  auto run = [&](int w) {
    const int64_t c0 = cost[items] * w / threads, c1 = cost[items] * (w + 1) / threads;
    const int64_t first = std::lower_bound(cost.begin(), cost.end() - 1, c0) - cost.begin();
    // Page scratch on the heap, once per thread (up to 512 KiB: too much for small stacks).
    std::vector<float> pages(2 * static_cast<size_t>(p.block_size) * p.head_size);
    for (int64_t i = first; i < items && cost[i] < c1; ++i)
      attend(p, i / p.kv_heads, i % p.kv_heads, pages.data());
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int w = 1; w < threads; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedDecodeCpu, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q rows [S, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // cache pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables [S, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lo [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // hi [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [S, Hq, D]
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("storage")
                                  .Attr<int32_t>("num_threads"));

// bf16 matmul of linear layers whose kernels were packed at load time, on Intel AMX tiles or
// AVX512-BF16 dot products: an XLA FFI custom call.
//
// y [M, N] f32 (or rounded to bf16) = x [M, K] bf16 @ w [K, N] bf16, with w given packed as
// [NB, KB, 2, 16, 32] bf16 (NB = ceil(N / 32), KB = ceil(K / 32), zero-padded): for the 32
// columns of block j and the 32 inputs of block kb, two 16 x 32 tiles (columns 0-15, 16-31),
// row r of a tile holding, for each of its 16 columns c, the pair w[32 kb + 2 r][c],
// w[32 kb + 2 r + 1][c] side by side: the "VNNI" order TDPBF16PS reads. A column block's
// tiles for all of K are contiguous (KB x 2 KiB), so a thread streams them in order.
// (`jaxkv.pallas_kernels.amx.pack` writes the layout; `amx.unpack` reverses it.)
//
// One TDPBF16PS multiplies a 16 x 32 bf16 tile of x by a 32 x 16 tile of w into a 16 x 16 f32
// tile. Eight tile registers hold a 32 x 32 block of y: four accumulators, two row tiles of x,
// two column tiles of w, so each loaded tile feeds two products. Work items are (chunk of
// column blocks, group of up to 4 row blocks), chunk-major; each thread takes whole items
// (ParallelFor) and runs each column block of its chunk against the group's row blocks in turn.
// With one group (up to 128 rows: decode steps) a chunk is one column block, so the threads
// split the weights finely and each weight is read from memory once; with more, a chunk is ~1
// MiB of packed weights, which stay in L2 while the row groups pass over them.
// x's rows are read in place when K is a multiple of 32; the last, partial block of 32 rows
// (and every block when K is not) is first copied into zero-padded tiles.
//
// AVX512-BF16 dot products (VDPBF16PS) read the same packed tile rows, each a 64-byte vector
// of 16 columns' input pairs: up to 4 rows of x on AMX machines (a decode step of a few
// sequences: a row costs no padding to 16), every product on CPUs with AVX512-BF16 and no AMX
// (AMD Zen 4 and later, Intel Cooper Lake). DotBlock sums R rows of x against C column blocks
// (R x 2C accumulators), broadcasting each input pair of a row against a tile row of weights.
// Its work items are split as the tiles' are, and each pulls the next item's weights (one
// group of rows: a decode step) or its next rows of x (many rows) into cache as it runs.
// Products of many rows run on XLA's pool, not the Helpers (kernel_common.h): a prefill step's
// products take milliseconds each, and XLA's other threads stay runnable between them, so a
// helper's spin took their core (gate / up products 20-25 ms instead of 17 at 4096 x 576 x
// 1536 inside a SmolLM2 prefill step, 2 cores).
//
// Two more handlers run the same product with another epilogue: the greedy LM head keeps each
// column's first maximum instead of storing y (JaxkvBf16FirstMaxCpu), and a SwiGLU MLP's gate
// and up projections, packed separately, are read as alternating column blocks and stored as
// silu(gate) * up (JaxkvBf16GatedCpu).
//
// Why it exists: XLA:CPU reads a bf16 kernel in its [K, N] layout and, on 2 cores, runs a
// decode step's products well below the machine's peak. Intel Xeon (AMX): XLA's bf16 dot (f32
// results) at 64 x 576 x 1536 in 0.22-0.25 ms, the tiles 0.14-0.17 ms, one row 0.03-0.05 ms.
// AMD EPYC (Zen 4, AVX512-BF16, no AMX; peak 464 GFLOP/s measured with a register-only
// VDPBF16PS loop): XLA 0.38 ms (300 GFLOP/s), the dot products 0.26 ms (430 GFLOP/s); 2048
// rows 8.4 against 9.0 ms (benchmarks/RESULTS.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXKV_BF16_DOT 1
#include <immintrin.h>
#endif
#if defined(JAXKV_BF16_DOT) && defined(__AMX_BF16__) && defined(__AMX_TILE__) && \
    defined(__linux__)
#define JAXKV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;         // rows, columns and inputs of one block of y (2 x 2 tiles)
constexpr int64_t kTileBf16 = 512;     // bf16 values of one tile (16 rows of 64 bytes)
constexpr int64_t kFewRows = 4;        // rows up to which AVX512-BF16 dot products run
constexpr int64_t kDotRows = 6;        // rows of y a DotBlock sums together
constexpr int64_t kDotGroupRows = 96;  // rows of a work item of the dot products
constexpr int64_t kGroupBlocks = 4;    // blocks of 32 rows run against each column block in turn
constexpr int64_t kChunkBytes = 1 << 20;  // packed weights of the column blocks of one work item

// Whether this process may run AMX tiles: the build has AMX-BF16 and Linux grants the tile
// data state (asked once; the permission is process-wide and survives fork).
[[maybe_unused]] bool AmxReady() {
#if defined(JAXKV_AMX)
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
#else
  return false;
#endif
}

#if defined(JAXKV_AMX)

// Tiles 0-3: accumulators (16 x 16 f32); 4-5: x (16 x 32 bf16); 6-7: w (16 x 16 pairs).
void Configure() {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

#endif  // JAXKV_AMX

#if defined(JAXKV_BF16_DOT)

// Cache lines still to prefetch, one per step of a DotBlock: the next work item's weights, or
// the next group's rows of x.
struct Ahead {
  const char* at;
  const char* end;
};

struct Problem {
  const uint16_t* x;     // [m, k] bf16 bits (the dot products: [m, kp], zero past k)
  const uint16_t* w;     // [nb, kb, 2, 16, 32] packed
  const uint16_t* tail;  // the zero-padded copy of x's rows [tail_row, m): [32, kp] (or all)
  int64_t tail_row;      // first row read from `tail` (a multiple of 32)
  int64_t m, k, n, kp;
  void* y;               // [m, n] f32, or bf16 when `bf16_out`
  bool bf16_out;
  // The greedy head: instead of y, each group of `fold_rows` rows keeps every column's first
  // maximum over its rows (value, row) in fold_val / fold_idx [groups, n]; nullptr: store y.
  float* fold_val = nullptr;
  int32_t* fold_idx = nullptr;
  int64_t fold_rows = 0;
  // A SwiGLU MLP's silu(x @ gate) * (x @ up) (rounded as GatedMLP rounds them), bf16 y [m, n]:
  // `w` holds the gate's packed blocks and `w_up` the up projection's; column block 2 j of the
  // product is the gate's block j, 2 j + 1 the up's. nullptr: a plain product.
  const uint16_t* w_up = nullptr;

  // bf16 values of one column block's tiles (all of K), and where block j's start.
  int64_t block_values() const { return kp / kBlock * 2 * kTileBf16; }
  const uint16_t* column_block(int64_t j) const {
    if (w_up) return ((j & 1) ? w_up : w) + (j >> 1) * block_values();
    return w + j * block_values();
  }
};

// 16 floats rounded to bf16 (nearest even), back as floats.
inline __m512 RoundBf16(__m512 v) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// exp(x) for x <= 0: 2^n * p(r), a degree-7 Taylor polynomial on |r| <= ln2 / 2 (relative
// error < 1e-7); 0 below -87 (f32 underflow).
inline __m512 ExpNonPositive(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 q = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(c));
  const __m512 e = _mm512_scalef_ps(q, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), e,
                              _mm512_setzero_ps());
}

// SiLU, x * sigmoid(x), in f32: sigmoid from e = exp(-|x|) (no exponential overflows), as
// 1 / (1 + e) for x >= 0 and e / (1 + e) below.
inline __m512 Silu(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));  // sigmoid(|x|)
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(x, _mm512_mask_mul_ps(inv, neg, e, inv));
}

// y[row, c0 : c0 + cols] (bf16) from the gate's and the up projection's f32 sums, rounded as
// GatedMLP rounds on bf16 layers: g and u to bf16 (each linear's output), silu(g) to bf16,
// then their f32 product to bf16.
inline void StoreGatedRow(const float* g, const float* u, int64_t cols, const Problem& p,
                          int64_t row, int64_t c0) {
  uint16_t* out = static_cast<uint16_t*>(p.y) + row * p.n + c0;
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t w = std::min<int64_t>(16, cols - c);
    const __mmask16 mask = w == 16 ? 0xffff : static_cast<__mmask16>((1u << w) - 1);
    const __m512 a = RoundBf16(Silu(RoundBf16(_mm512_loadu_ps(g + c))));
    const __m512 v = _mm512_mul_ps(a, RoundBf16(_mm512_loadu_ps(u + c)));
    _mm256_mask_storeu_epi16(out + c, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Row `row` of y, columns [c0, c0 + cols), folded into its group's first maxima: a column
// takes the row where its value is larger, or is NaN over a number (jnp.argmax's order: the
// first NaN, else the first maximum). Rows of a group arrive in increasing order.
inline void FoldRow(const float* v, int64_t cols, const Problem& p, int64_t row, int64_t c0) {
  const int64_t at = row / p.fold_rows * p.n + c0;
  float* best = p.fold_val + at;
  int32_t* idx = p.fold_idx + at;
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t w = std::min<int64_t>(16, cols - c);
    const __mmask16 mask = w == 16 ? 0xffff : static_cast<__mmask16>((1u << w) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(mask, v + c);
    const __m512 b = _mm512_maskz_loadu_ps(mask, best + c);
    const __mmask16 nan_over_number =
        _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    const __mmask16 take = mask & (_mm512_cmp_ps_mask(x, b, _CMP_GT_OQ) | nan_over_number);
    _mm512_mask_storeu_ps(best + c, take, x);
    _mm512_mask_storeu_epi32(idx + c, take, _mm512_set1_epi32(static_cast<int>(row)));
  }
}

// y[row, c0 : c0 + cols] = v[:cols] (cols <= 32), rounded to bf16 (nearest even) for a bf16 y;
// or folded into the greedy head's maxima.
inline void StoreRow(const float* v, int64_t cols, const Problem& p, int64_t row, int64_t c0) {
  if (p.fold_val) {
    FoldRow(v, cols, p, row, c0);
    return;
  }
  if (!p.bf16_out) {
    std::memcpy(static_cast<float*>(p.y) + row * p.n + c0, v, cols * 4);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(p.y) + row * p.n + c0;
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t w = std::min<int64_t>(16, cols - c);
    const __mmask16 mask = w == 16 ? 0xffff : static_cast<__mmask16>((1u << w) - 1);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, v + c));
    _mm256_mask_storeu_epi16(out + c, mask, (__m256i)b);
  }
}

// Rows [row0, row0 + R) of y, columns of the C column blocks from block j, off the tiles' rows
// with AVX512-BF16 dot products: a tile row is 16 columns' input pairs, the operand VDPBF16PS
// takes, and each pair of a row of x is broadcast against it. R x 2C accumulators (R = 6,
// C = 2: 24 of the 32 vector registers) take each loaded vector of weights R times and each
// broadcast 2C times. x: p.x's rows of kp values (zero past k). No tile is padded to 16 rows,
// so one row reads no more than it needs.
template <int R, int C>
void DotBlock(const Problem& p, int64_t row0, int64_t j, Ahead& ahead) {
  const int64_t kp = p.kp, c0 = j * kBlock;
  const uint16_t* __restrict__ x = p.x + row0 * kp;
  const uint16_t* pack[C];
  for (int c = 0; c < C; ++c) pack[c] = p.column_block(j + c);
  __m512 acc[R][2 * C];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int t = 0; t < 2 * C; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int64_t kb = 0; kb < kp / kBlock; ++kb) {
    const int64_t at = kb * 2 * kTileBf16;
    const uint16_t* xk = x + kb * kBlock;
#pragma GCC unroll 2
    for (int r = 0; r < 16; ++r) {
      __m512bh w[2 * C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint16_t* tiles = pack[c] + at;
        w[2 * c] = (__m512bh)_mm512_loadu_si512(tiles + r * 32);
        w[2 * c + 1] = (__m512bh)_mm512_loadu_si512(tiles + kTileBf16 + r * 32);
        // the same tile rows two blocks of inputs on
        _mm_prefetch(reinterpret_cast<const char*>(tiles + 4 * kTileBf16 + r * 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tiles + 5 * kTileBf16 + r * 32), _MM_HINT_T0);
      }
      if (ahead.at < ahead.end) {  // a line of the next work item's weights, into L2
        _mm_prefetch(ahead.at, _MM_HINT_T1);
        ahead.at += 64;
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        uint32_t pair;
        std::memcpy(&pair, xk + i * kp + 2 * r, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
        for (int t = 0; t < 2 * C; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], xb, w[t]);
      }
    }
  }
  alignas(64) float row[kBlock];
  if (p.w_up) {  // blocks (gate, up) in pairs: C is even here (whole pairs of blocks)
    if constexpr (C % 2 == 0) {
      alignas(64) float up[kBlock];
      for (int c = 0; c < C; c += 2) {
        const int64_t out0 = (j + c) / 2 * kBlock;
        for (int i = 0; i < R; ++i) {
          _mm512_store_ps(row, acc[i][2 * c]);
          _mm512_store_ps(row + 16, acc[i][2 * c + 1]);
          _mm512_store_ps(up, acc[i][2 * c + 2]);
          _mm512_store_ps(up + 16, acc[i][2 * c + 3]);
          StoreGatedRow(row, up, std::min(kBlock, p.n - out0), p, row0 + i, out0);
        }
      }
    }
    return;
  }
  for (int c = 0; c < C; ++c) {
    const int64_t cols = std::min(kBlock, p.n - c0 - c * kBlock);
    for (int i = 0; i < R; ++i) {
      _mm512_store_ps(row, acc[i][2 * c]);
      _mm512_store_ps(row + 16, acc[i][2 * c + 1]);
      StoreRow(row, cols, p, row0 + i, c0 + c * kBlock);
    }
  }
}

// Rows [i, i + R) of y, column blocks [j0, j1): DotBlock on fours (one or two rows) or pairs
// of blocks, then one block.
template <int R>
void DotGroup(const Problem& p, int64_t i, int64_t j0, int64_t j1, Ahead& ahead) {
  int64_t j = j0;
  if constexpr (R <= 2) {  // more weights in flight for a row or two (memory-bound)
    for (; j + 4 <= j1; j += 4) DotBlock<R, 4>(p, i, j, ahead);
  }
  for (; j + 2 <= j1; j += 2) DotBlock<R, 2>(p, i, j, ahead);
  for (; j < j1; ++j) DotBlock<R, 1>(p, i, j, ahead);
}

// Rows [row0, row1) of y (groups of kDotRows, then the rest), column blocks [j0, j1): each
// group of rows passes over all the blocks, so its rows of x stay in L1 and the blocks' tiles
// in L2.
void DotRows(const Problem& p, int64_t row0, int64_t row1, int64_t j0, int64_t j1,
             Ahead& ahead) {
  const bool rows_ahead = ahead.at == nullptr;  // else the item streams the next weights
  for (int64_t i = row0; i < row1; i += kDotRows) {
    if (rows_ahead) {  // the next group's rows of x, from memory while these run
      ahead.at = reinterpret_cast<const char*>(p.x + std::min(row1, i + kDotRows) * p.kp);
      ahead.end = reinterpret_cast<const char*>(p.x + std::min(row1, i + 2 * kDotRows) * p.kp);
    }
    switch (std::min<int64_t>(kDotRows, row1 - i)) {
      case 1: DotGroup<1>(p, i, j0, j1, ahead); break;
      case 2: DotGroup<2>(p, i, j0, j1, ahead); break;
      case 3: DotGroup<3>(p, i, j0, j1, ahead); break;
      case 4: DotGroup<4>(p, i, j0, j1, ahead); break;
      case 5: DotGroup<5>(p, i, j0, j1, ahead); break;
      default: DotGroup<kDotRows>(p, i, j0, j1, ahead);
    }
  }
}

#endif  // JAXKV_BF16_DOT

#if defined(JAXKV_AMX)

// Rows [r0, r0 + 32) of x @ column block `pack` (32 x 32 f32) into `out`, rows `ld` floats
// apart.
void Tiles(const Problem& p, int64_t r0, const uint16_t* __restrict__ pack, float* out,
           int64_t ld) {
  const bool padded = r0 >= p.tail_row;
  const uint16_t* x = padded ? p.tail + (r0 - p.tail_row) * p.kp : p.x + r0 * p.k;
  const int64_t stride = (padded ? p.kp : p.k) * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t row16 = stride * 16 / 2;  // bf16 values from row 0 to row 16
  for (int64_t kb = 0; kb < p.kp / kBlock; ++kb) {
    _tile_loadd(4, x + kb * kBlock, stride);
    _tile_loadd(5, x + row16 + kb * kBlock, stride);
    _tile_loadd(6, pack + kb * 2 * kTileBf16, 64);
    _tile_loadd(7, pack + kb * 2 * kTileBf16 + kTileBf16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, ld * 4);
  _tile_stored(1, out + 16, ld * 4);
  _tile_stored(2, out + 16 * ld, ld * 4);
  _tile_stored(3, out + 16 * ld + 16, ld * 4);
}

// Rows [r0, r0 + 32) of y, columns [c0, c0 + 32) from column block `pack`: an f32 y's whole
// blocks straight from the tiles, the rest through `ragged` (32 x 32 floats) and StoreRow.
void Block(const Problem& p, int64_t r0, int64_t c0, const uint16_t* __restrict__ pack,
           float* __restrict__ ragged) {
  if (!p.bf16_out && !p.fold_val && r0 + kBlock <= p.m && c0 + kBlock <= p.n) {
    Tiles(p, r0, pack, static_cast<float*>(p.y) + r0 * p.n + c0, p.n);
    return;
  }
  Tiles(p, r0, pack, ragged, kBlock);
  const int64_t rows = std::min(kBlock, p.m - r0), cols = std::min(kBlock, p.n - c0);
  for (int64_t i = 0; i < rows; ++i) StoreRow(ragged + i * kBlock, cols, p, r0 + i, c0);
}

// The gated product's rows [r0, r0 + 32), output columns [c0, c0 + 32): the gate's and the
// up's blocks (2 j, 2 j + 1 of the product) through `ragged` (2 x 32 x 32 floats).
void GatedBlock(const Problem& p, int64_t r0, int64_t j, float* __restrict__ ragged) {
  Tiles(p, r0, p.column_block(2 * j), ragged, kBlock);
  Tiles(p, r0, p.column_block(2 * j + 1), ragged + kBlock * kBlock, kBlock);
  const int64_t rows = std::min(kBlock, p.m - r0), cols = std::min(kBlock, p.n - j * kBlock);
  for (int64_t i = 0; i < rows; ++i)
    StoreGatedRow(ragged + i * kBlock, ragged + (kBlock + i) * kBlock, cols, p, r0 + i, j * kBlock);
}

#endif  // JAXKV_AMX

// Zero-padded tiles of x's rows [row0, m): [round_up(m - row0, 32), kp] bf16, kept per thread.
[[maybe_unused]] const uint16_t* PadRows(const uint16_t* x, int64_t row0, int64_t m, int64_t k,
                                         int64_t kp) {
  thread_local std::vector<uint16_t> buf;
  const int64_t rows = (m - row0 + kBlock - 1) / kBlock * kBlock;
  if (static_cast<int64_t>(buf.size()) < rows * kp) buf.resize(rows * kp);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* out = buf.data() + i * kp;
    const int64_t have = row0 + i < m ? k : 0;
    if (have) std::memcpy(out, x + (row0 + i) * k, k * 2);
    std::fill(out + have, out + kp, uint16_t{0});
  }
  return buf.data();
}

#if defined(JAXKV_BF16_DOT)

// The greedy head's partial maxima (Problem::fold_val / fold_idx), sized by Product once it
// knows its groups of rows; a column's entries start at (-inf, the group's first row).
struct Fold {
  std::vector<float> val;
  std::vector<int32_t> idx;

  void Start(Problem& p, int64_t group_rows) {
    const int64_t groups = (p.m + group_rows - 1) / group_rows;
    val.assign(groups * p.n, -std::numeric_limits<float>::infinity());
    idx.resize(groups * p.n);
    for (int64_t g = 0; g < groups; ++g) {
      std::fill(idx.begin() + g * p.n, idx.begin() + (g + 1) * p.n,
                static_cast<int32_t>(g * group_rows));
    }
    p.fold_val = val.data();
    p.fold_idx = idx.data();
    p.fold_rows = group_rows;
  }

  // Column c's first maximum over all rows (groups in order, the rule of FoldRow).
  int32_t Column(int64_t n, int64_t c) const {
    float best = val[c];
    int32_t at = idx[c];
    for (size_t g = 1; g * n < val.size(); ++g) {
      const float x = val[g * n + c];
      if (x > best || (std::isnan(x) && !std::isnan(best))) {
        best = x;
        at = idx[g * n + c];
      }
    }
    return at;
  }
};

// p.x [m, k] @ p.w (packed) on the dot products or the tiles, stored to p.y ([m, n] f32 or
// bf16), or, with `fold`, folded into each column's first maximum, or gated (p.w_up). `p`
// comes with x, w, m, k, n, y, bf16_out and the gated fields set; the rest is filled here.
ffi::Error Product(ffi::ThreadPool& pool, Problem p, Fold* fold, int threads, bool tiles) {
  const int64_t m = p.m, k = p.k, kb = (k + kBlock - 1) / kBlock;
  const int64_t nb = (p.n + kBlock - 1) / kBlock * (p.w_up ? 2 : 1);  // column blocks
  const int64_t kp = kb * kBlock;
  const uint16_t* xs = p.x;
  p.kp = kp;
  if (m <= kFewRows || !tiles || !AmxReady()) {  // AVX512-BF16 dot products off the tiles
    p.x = k == kp ? xs : PadRows(xs, 0, m, k, kp);
    p.tail = nullptr;
    p.tail_row = 0;
    // Work items (chunk of column blocks, group of rows), chunk-major, as for the tiles below:
    // one group when the rows are few (a decode step), and then two or four blocks a chunk.
    const int64_t group_rows = m <= 2 * kDotGroupRows ? m : kDotGroupRows;
    if (fold) fold->Start(p, group_rows);
    const int64_t groups = (m + group_rows - 1) / group_rows;
    const int64_t chunk =
        groups > 1 ? std::max<int64_t>(2, kChunkBytes / 2 / (kp * kBlock * 2) / 2 * 2)
                   : (m <= kFewRows ? 4 : 2);
    const int64_t chunks = (nb + chunk - 1) / chunk;
    const int64_t items = chunks * groups;
    // A few rows stream the weights from memory: one contiguous run of them a thread.
    const int parts =
        static_cast<int>(std::min<int64_t>(items, (m <= kFewRows ? 1 : 4) * threads));
    const auto run = [&p, m, nb, items, parts, groups, chunk, group_rows](int part) {
      for (int64_t item = items * part / parts; item < items * (part + 1) / parts; ++item) {
        const int64_t j0 = item / groups * chunk, r0 = item % groups * group_rows;
        // One group of rows: the next item's weights stream into L2 while this one's run.
        Ahead ahead{nullptr, nullptr};
        if (groups == 1 && item + 1 < items * (part + 1) / parts) {
          ahead.at = reinterpret_cast<const char*>(p.column_block(std::min(nb, j0 + chunk)));
          ahead.end = reinterpret_cast<const char*>(p.column_block(std::min(nb, j0 + 2 * chunk)));
        }
        DotRows(p, r0, std::min(m, r0 + group_rows), j0, std::min(nb, j0 + chunk), ahead);
      }
    };
    jaxkv_cpu::ParallelFor(pool, threads, parts, run,
                           groups > 1 ? jaxkv_cpu::Team::kPool : jaxkv_cpu::Team::kHelpers);
    return ffi::Error::Success();
  }
#if defined(JAXKV_AMX)
  // Rows read in place: whole blocks of 32, when K is a multiple of 32.
  p.tail_row = k == kp ? m / kBlock * kBlock : 0;
  p.tail = p.tail_row < m ? PadRows(xs, p.tail_row, m, k, kp) : nullptr;
  if (fold) fold->Start(p, kGroupBlocks * kBlock);
  const int64_t row_blocks = (m + kBlock - 1) / kBlock;
  const int64_t groups = (row_blocks + kGroupBlocks - 1) / kGroupBlocks;
  // Column blocks per chunk: one (the finest split) when all rows form one group, else as many
  // as fit kChunkBytes, so that a chunk's tiles stay in L2 while every row group passes.
  int64_t chunk = groups == 1 ? 1 : std::max<int64_t>(1, kChunkBytes / (kp * kBlock * 2));
  if (p.w_up) chunk = (chunk + 1) / 2 * 2;  // whole pairs of (gate, up) blocks
  const int64_t chunks = (nb + chunk - 1) / chunk;
  const int64_t items = chunks * groups;  // chunk-major
  const int parts = static_cast<int>(std::min<int64_t>(items, 4 * threads));
  jaxkv_cpu::ParallelFor(pool, threads, parts, [&p, items, parts, groups, chunk, nb,
                                                row_blocks](int part) {
    Configure();  // tile configuration is per thread
    alignas(64) float ragged[2 * kBlock * kBlock];
    for (int64_t item = items * part / parts; item < items * (part + 1) / parts; ++item) {
      const int64_t j0 = item / groups * chunk, rb0 = item % groups * kGroupBlocks;
      const int64_t rb1 = std::min(row_blocks, rb0 + kGroupBlocks);
      for (int64_t j = j0; j < std::min(nb, j0 + chunk); ++j) {
        if (p.w_up) {  // a pair of blocks (gate, up): chunks are whole pairs
          if (j % 2 == 0)
            for (int64_t rb = rb0; rb < rb1; ++rb) GatedBlock(p, rb * kBlock, j / 2, ragged);
          continue;
        }
        const uint16_t* pack = p.column_block(j);
        for (int64_t rb = rb0; rb < rb1; ++rb) Block(p, rb * kBlock, j * kBlock, pack, ragged);
      }
    }
    _tile_release();
  });
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jaxkv bf16 matmul: no AMX tiles");
#endif
}

#endif  // JAXKV_BF16_DOT

// x [M, K] and w packed [ceil(N / 32), ceil(K / 32), 2, 16, 32]; "" when they fit, else why.
const char* CheckOperands(ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& w, int64_t n) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t k = xd.size() == 2 ? xd[1] : -1;
  const int64_t nb = (n + kBlock - 1) / kBlock, kb = (k + kBlock - 1) / kBlock;
  if (xd.size() != 2 || wd.size() != 5 || n < 0 || wd[0] != nb || wd[1] != kb || wd[2] != 2 ||
      wd[3] != 16 || wd[4] != 32) {
    return "x [M, K] bf16 and w packed [ceil(N / 32), ceil(K / 32), 2, 16, 32] bf16 expected";
  }
  return "";
}

ffi::Error AmxMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                         ffi::Buffer<ffi::BF16> w, ffi::Result<ffi::AnyBuffer> y, int64_t n,
                         int32_t num_threads, int32_t tiles) {
  if (const char* bad = CheckOperands(x, w, n); *bad) {
    return ffi::Error::InvalidArgument(std::string("jaxkv AMX matmul: ") + bad);
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  const auto yd = y->dimensions();
  const bool bf16_out = y->element_type() == ffi::DataType::BF16;
  if ((!bf16_out && y->element_type() != ffi::DataType::F32) || yd.size() != 2 || yd[0] != m ||
      yd[1] != n) {
    return ffi::Error::InvalidArgument("jaxkv AMX matmul: y [M, N] f32 or bf16 expected");
  }
  void* out = y->untyped_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(out, 0, m * n * (bf16_out ? 2 : 4));
    return ffi::Error::Success();
  }
#if defined(JAXKV_BF16_DOT)
  Problem p{reinterpret_cast<const uint16_t*>(x.typed_data()),
            reinterpret_cast<const uint16_t*>(w.typed_data()), nullptr, 0, m, k, n, 0, out,
            bf16_out};
  return Product(pool, p, nullptr, jaxkv_cpu::Threads(pool, num_threads), tiles != 0);
#else
  (void)pool, (void)num_threads, (void)tiles;
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxkv bf16 matmul: this build has no AVX512-BF16");
#endif
}

// A SwiGLU MLP's hidden layer: y [M, n] bf16 = silu(x @ gate) * (x @ up), each factor rounded
// as GatedMLP rounds it (gate and up to bf16, silu(gate) to bf16, the product to bf16): equal
// to XLA's (jax.nn.silu in f32) on every value tried. One pass over x for both projections,
// and neither [M, n] projection is written: XLA's multiply fusion read both and wrote y
// (3.4 ms of a 4096-token SmolLM2 prefill layer, 0.07-0.11 ms of a 64-row decode layer).
ffi::Error GatedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gate,
                     ffi::Buffer<ffi::BF16> up, ffi::ResultBuffer<ffi::BF16> y, int64_t n,
                     int32_t num_threads, int32_t tiles) {
  if (const char* bad = CheckOperands(x, gate, n); *bad) {
    return ffi::Error::InvalidArgument(std::string("jaxkv bf16 gated matmul: ") + bad);
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  const auto gd = gate.dimensions(), ud = up.dimensions(), yd = y->dimensions();
  if (!std::equal(gd.begin(), gd.end(), ud.begin(), ud.end()) || yd.size() != 2 ||
      yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument(
        "jaxkv bf16 gated matmul: gate and up packed alike and y [M, N] bf16 expected");
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(y->typed_data());
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // silu(0) * 0
    std::fill(out, out + m * n, uint16_t{0});
    return ffi::Error::Success();
  }
#if defined(JAXKV_BF16_DOT)
  Problem p{reinterpret_cast<const uint16_t*>(x.typed_data()),
            reinterpret_cast<const uint16_t*>(gate.typed_data()), nullptr, 0, m, k, n, 0, out,
            true};
  p.w_up = reinterpret_cast<const uint16_t*>(up.typed_data());
  return Product(pool, p, nullptr, jaxkv_cpu::Threads(pool, num_threads), tiles != 0);
#else
  (void)pool, (void)num_threads, (void)tiles;
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxkv bf16 gated matmul: this build has no AVX512-BF16");
#endif
}

// The greedy LM head: first_max[c] = the first row of x @ w with the largest value in column c
// (jnp.argmax over axis 0, a NaN first), without storing the [M, N] product. x holds the
// head's [V, K] weights, w the packed [K, R] transposed hidden rows.
ffi::Error FirstMaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                        ffi::ResultBuffer<ffi::S32> first_max, int64_t n, int32_t num_threads,
                        int32_t tiles) {
  if (const char* bad = CheckOperands(x, w, n); *bad) {
    return ffi::Error::InvalidArgument(std::string("jaxkv bf16 first max: ") + bad);
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  if (first_max->element_count() != static_cast<size_t>(n) || m == 0) {
    return ffi::Error::InvalidArgument("jaxkv bf16 first max: M > 0 rows and [N] int32 expected");
  }
  int32_t* at = first_max->typed_data();
  if (k == 0) {  // every value 0: the first row
    std::fill(at, at + n, 0);
    return ffi::Error::Success();
  }
#if defined(JAXKV_BF16_DOT)
  Fold fold;
  Problem p{reinterpret_cast<const uint16_t*>(x.typed_data()),
            reinterpret_cast<const uint16_t*>(w.typed_data()), nullptr, 0, m, k, n, 0, nullptr,
            false};
  if (ffi::Error e = Product(pool, p, &fold, jaxkv_cpu::Threads(pool, num_threads), tiles != 0);
      e.failure()) {
    return e;
  }
  for (int64_t c = 0; c < n; ++c) at[c] = fold.Column(n, c);
  return ffi::Error::Success();
#else
  (void)pool, (void)num_threads, (void)tiles;
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxkv bf16 first max: this build has no AVX512-BF16");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvBf16GatedCpu, GatedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // gate packed [NB, KB, ...]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // up packed, the same shape
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y [M, N]
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("num_threads")
                                  .Attr<int32_t>("tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvBf16FirstMaxCpu, FirstMaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]: the head [V, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w packed: hidden^T [K, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // first_max [N = R]
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("num_threads")
                                  .Attr<int32_t>("tiles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvAmxMatmulCpu, AmxMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [NB, KB, 2, 16, 32]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N] f32 | bf16
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("num_threads")
                                  .Attr<int32_t>("tiles"));  // 0: dot products at any M

// 1 when this library was built with AVX512-BF16 (the packed layout's dot-product path).
extern "C" int JaxkvBf16DotReady() {
#if defined(JAXKV_BF16_DOT)
  return 1;
#else
  return 0;
#endif
}

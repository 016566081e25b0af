// bf16 matmul on Intel AMX tiles, for linear layers whose kernels were packed at load time:
// an XLA FFI custom call.
//
// y [M, N] f32 (or rounded to bf16) = x [M, K] bf16 @ w [K, N] bf16, with w given packed as
// [NB, KB, 2, 16, 32] bf16 (NB = ceil(N / 32), KB = ceil(K / 32), zero-padded): for the 32
// columns of block j and the 32 inputs of block kb, two 16 x 32 tiles (columns 0-15, 16-31),
// row r of a tile holding, for each of its 16 columns c, the pair w[32 kb + 2 r][c],
// w[32 kb + 2 r + 1][c] side by side: the "VNNI" order TDPBF16PS reads. A column block's
// tiles for all of K are contiguous (KB x 2 KiB), so a thread streams them in order.
// (`jaxkv.pallas_kernels.cpu_backend.pack_amx` writes the layout; `unpack_amx` reverses it.)
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
// Up to 4 rows (a decode step of a few sequences) skip the tiles: AVX512-BF16 dot products
// (VDPBF16PS) read the same packed tile rows, each a 64-byte vector of 16 columns' input
// pairs, so a row costs no padding to 16.
//
// Why it exists: XLA:CPU's bf16 dot (f32 results) runs at ~450-500 GFLOP/s on 2 cores at
// 64 x 576 x 1536 (a decode step of 64 sequences of a 135M model spends most of its time in
// such dots) and reads the weights in their [K, N] layout; repacking them into tiles on every
// call costs more than the tiles save. Packed once, the same product takes 0.14-0.17 ms
// against XLA's 0.22-0.25 ms, and one row 0.03-0.05 ms (benchmarks/RESULTS.md).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define JAXKV_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;         // rows, columns and inputs of one block of y (2 x 2 tiles)
constexpr int64_t kTileBf16 = 512;     // bf16 values of one tile (16 rows of 64 bytes)
constexpr int64_t kFewRows = 4;        // rows up to which AVX512-BF16 dot products run
constexpr int64_t kGroupBlocks = 4;    // blocks of 32 rows run against each column block in turn
constexpr int64_t kChunkBytes = 1 << 20;  // packed weights of the column blocks of one work item

// Whether this process may run AMX tiles: the build has AMX-BF16 and Linux grants the tile
// data state (asked once; the permission is process-wide and survives fork).
bool AmxReady() {
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

struct Problem {
  const uint16_t* x;     // [m, k] bf16 bits
  const uint16_t* w;     // [nb, kb, 2, 16, 32] packed
  const uint16_t* tail;  // the zero-padded copy of x's rows [tail_row, m): [32, kp] (or all)
  int64_t tail_row;      // first row read from `tail` (a multiple of 32)
  int64_t m, k, n, kp;
  void* y;               // [m, n] f32, or bf16 when `bf16_out`
  bool bf16_out;
};

// y[row, c0 : c0 + cols] = v[:cols] (cols <= 32), rounded to bf16 (nearest even) for a bf16 y.
inline void StoreRow(const float* v, int64_t cols, const Problem& p, int64_t row, int64_t c0) {
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

// Rows [r0, r0 + 32) of y, columns [c0, c0 + 32) from column block `pack`; ragged edges go
// through `ragged` (32 x 32 floats).
void Block(const Problem& p, int64_t r0, int64_t c0, const uint16_t* __restrict__ pack,
           float* __restrict__ ragged) {
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
  if (!p.bf16_out && r0 + kBlock <= p.m && c0 + kBlock <= p.n) {
    float* out = static_cast<float*>(p.y) + r0 * p.n + c0;
    _tile_stored(0, out, p.n * 4);
    _tile_stored(1, out + 16, p.n * 4);
    _tile_stored(2, out + 16 * p.n, p.n * 4);
    _tile_stored(3, out + 16 * p.n + 16, p.n * 4);
    return;
  }
  _tile_stored(0, ragged, kBlock * 4);
  _tile_stored(1, ragged + 16, kBlock * 4);
  _tile_stored(2, ragged + 16 * kBlock, kBlock * 4);
  _tile_stored(3, ragged + 16 * kBlock + 16, kBlock * 4);
  const int64_t rows = std::min(kBlock, p.m - r0), cols = std::min(kBlock, p.n - c0);
  for (int64_t i = 0; i < rows; ++i) StoreRow(ragged + i * kBlock, cols, p, r0 + i, c0);
}

// Rows [i0, i0 + R) of y, columns [c0, c0 + 32), for a few rows of x: AVX512-BF16 dot
// products straight off the packed tiles (a tile row is the 16 columns' input pairs, the
// operand VDPBF16PS takes), one broadcast pair of x per row and tile row. x rows of kp
// values (zero-padded). No tile is padded to 16 rows, so one row reads no more than it needs.
template <int R>
void FewRows(const uint16_t* __restrict__ x, int64_t kp, const uint16_t* __restrict__ pack,
             const Problem& p, int64_t row0, int64_t c0) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kp / kBlock; ++kb) {
    const uint16_t* t = pack + kb * 2 * kTileBf16;
    for (int r = 0; r < 16; ++r) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t + r * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(t + kTileBf16 + r * 32);
      for (int i = 0; i < R; ++i) {
        uint32_t pair;
        std::memcpy(&pair, x + i * kp + kb * kBlock + 2 * r, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
      }
    }
  }
  const int64_t cols = std::min(kBlock, p.n - c0);
  alignas(64) float row[kBlock];
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(row, acc[i][0]);
    _mm512_store_ps(row + 16, acc[i][1]);
    StoreRow(row, cols, p, row0 + i, c0);
  }
}

#endif  // JAXKV_AMX

// Zero-padded tiles of x's rows [row0, m): [round_up(m - row0, 32), kp] bf16, kept per thread.
const uint16_t* PadRows(const uint16_t* x, int64_t row0, int64_t m, int64_t k, int64_t kp) {
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

ffi::Error AmxMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                         ffi::Buffer<ffi::BF16> w, ffi::Result<ffi::AnyBuffer> y, int64_t n,
                         int32_t num_threads) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t k = xd.size() == 2 ? xd[1] : -1;
  const int64_t nb = (n + kBlock - 1) / kBlock, kb = (k + kBlock - 1) / kBlock;
  if (xd.size() != 2 || wd.size() != 5 || n < 0 || wd[0] != nb || wd[1] != kb || wd[2] != 2 ||
      wd[3] != 16 || wd[4] != 32) {
    return ffi::Error::InvalidArgument(
        "jaxkv AMX matmul: x [M, K] bf16 and w packed [ceil(N / 32), ceil(K / 32), 2, 16, 32] "
        "bf16 expected");
  }
  const int64_t m = xd[0];
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
  if (!AmxReady()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxkv AMX matmul: this build or process cannot run AMX tiles");
  }
#if defined(JAXKV_AMX)
  const int64_t kp = kb * kBlock;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const int threads = jaxkv_cpu::Threads(pool, num_threads);
  if (m <= kFewRows) {  // a few rows: dot products off the tiles, column blocks split
    const uint16_t* xp = k == kp ? xs : PadRows(xs, 0, m, k, kp);
    const auto* ws = reinterpret_cast<const uint16_t*>(w.typed_data());
    const Problem p{xp, ws, nullptr, 0, m, k, n, kp, out, bf16_out};
    const int parts = static_cast<int>(std::min<int64_t>(nb, 4 * threads));
    jaxkv_cpu::ParallelFor(pool, threads, parts, [&p, nb, kb, kp, m, ws, xp, parts](int part) {
      for (int64_t j = nb * part / parts; j < nb * (part + 1) / parts; ++j) {
        const uint16_t* pack = ws + j * kb * 2 * kTileBf16;
        for (int64_t i = 0; i < m; i += 4) {
          const uint16_t* xi = xp + i * kp;
          switch (std::min<int64_t>(4, m - i)) {
            case 1: FewRows<1>(xi, kp, pack, p, i, j * kBlock); break;
            case 2: FewRows<2>(xi, kp, pack, p, i, j * kBlock); break;
            case 3: FewRows<3>(xi, kp, pack, p, i, j * kBlock); break;
            default: FewRows<4>(xi, kp, pack, p, i, j * kBlock);
          }
        }
      }
    });
    return ffi::Error::Success();
  }
  // Rows read in place: whole blocks of 32, when K is a multiple of 32.
  const int64_t tail_row = k == kp ? m / kBlock * kBlock : 0;
  const uint16_t* tail = tail_row < m ? PadRows(xs, tail_row, m, k, kp) : nullptr;
  const Problem p{xs, reinterpret_cast<const uint16_t*>(w.typed_data()), tail, tail_row, m, k,
                  n, kp, out, bf16_out};
  const int64_t row_blocks = (m + kBlock - 1) / kBlock;
  const int64_t groups = (row_blocks + kGroupBlocks - 1) / kGroupBlocks;
  // Column blocks per chunk: one (the finest split) when all rows form one group, else as many
  // as fit kChunkBytes, so that a chunk's tiles stay in L2 while every row group passes.
  const int64_t chunk = groups == 1 ? 1 : std::max<int64_t>(1, kChunkBytes / (kp * kBlock * 2));
  const int64_t chunks = (nb + chunk - 1) / chunk;
  const int64_t items = chunks * groups;  // chunk-major
  const int parts = static_cast<int>(std::min<int64_t>(items, 4 * threads));
  jaxkv_cpu::ParallelFor(pool, threads, parts, [&p, items, parts, groups, chunk, nb, row_blocks,
                                                kb](int part) {
    Configure();  // tile configuration is per thread
    alignas(64) float ragged[kBlock * kBlock];
    for (int64_t item = items * part / parts; item < items * (part + 1) / parts; ++item) {
      const int64_t j0 = item / groups * chunk, rb0 = item % groups * kGroupBlocks;
      const int64_t rb1 = std::min(row_blocks, rb0 + kGroupBlocks);
      for (int64_t j = j0; j < std::min(nb, j0 + chunk); ++j) {
        const uint16_t* pack = p.w + j * kb * 2 * kTileBf16;
        for (int64_t rb = rb0; rb < rb1; ++rb) Block(p, rb * kBlock, j * kBlock, pack, ragged);
      }
    }
    _tile_release();
  });
#endif
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvAmxMatmulCpu, AmxMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [NB, KB, 2, 16, 32]
                                  .Ret<ffi::AnyBuffer>()          // y [M, N] f32 | bf16
                                  .Attr<int64_t>("n")
                                  .Attr<int32_t>("num_threads"));

// 1 when this library and process can run AMX tiles (cpu_backend.amx_available).
extern "C" int JaxkvAmxReady() { return AmxReady() ? 1 : 0; }

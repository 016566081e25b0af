// KV write and page zeroing for the CPU: XLA FFI custom calls with the cache aliased in place.
//
// Token t's K and V rows (every KV head, already in the cache dtype: D * itemsize bytes each)
// are copied to slot slots[t] = block * bs + offset of the page-major cache [N, 2, Hkv, bs, D];
// slots < 0 (padding) or >= N * bs are skipped. The bytes are copied as they are, so every
// cache dtype (f32, bf16, f16, fp8) is one code path.
//
// Why it exists: on XLA:CPU the same write is a bitcast of the new K/V to bytes (a per-byte
// copy loop, ~4 ms per layer for a 2048-token step) and a scatter of byte rows; here it is one
// memcpy per row (see benchmarks/RESULTS.md). Zeroing new pages goes with it: XLA's scatter of
// zero pages materialises the zeros and, next to these calls, copied the whole buffer.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKvImpl(ffi::AnyBuffer cache, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out,
                       int32_t block_size) {
  const auto kd = k.dimensions();
  if (kd.size() != 3 || v.dimensions().size() != 3 || k.element_type() != v.element_type() ||
      v.dimensions()[0] != kd[0] || v.dimensions()[1] != kd[1] || v.dimensions()[2] != kd[2] ||
      slots.element_count() != static_cast<size_t>(kd[0]) || block_size <= 0 ||
      cache.element_type() != ffi::DataType::U8) {
    return ffi::Error::InvalidArgument("jaxkv write_kv: k, v [T, Hkv, D] of one dtype, slots [T], "
                                       "a flat uint8 cache expected");
  }
  const int64_t tokens = kd[0], heads = kd[1];
  const int64_t row = kd[2] * static_cast<int64_t>(ffi::ByteWidth(k.element_type()));
  const int64_t page = 2 * heads * block_size * row;
  const int64_t total = static_cast<int64_t>(cache.size_bytes());
  if (row <= 0 || total % page != 0 || out->size_bytes() != cache.size_bytes()) {
    return ffi::Error::InvalidArgument("jaxkv write_kv: the cache is not a whole number of pages");
  }
  uint8_t* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), total);  // not aliased
  const int64_t num_slots = total / page * block_size;
  const uint8_t* src[2] = {static_cast<const uint8_t*>(k.untyped_data()),
                           static_cast<const uint8_t*>(v.untyped_data())};
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0 || slot[t] >= num_slots) continue;
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    for (int c = 0; c < 2; ++c)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + (((block * 2 + c) * heads + h) * block_size + offset) * row,
                    src[c] + (t * heads + h) * row, row);
  }
  return ffi::Error::Success();
}

// Pages ids[i] (page_bytes each) of a flat cache set to zero; ids < 0 or past the end skipped.
ffi::Error ZeroPagesImpl(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> ids,
                         ffi::Result<ffi::AnyBuffer> out, int64_t page_bytes) {
  const int64_t total = static_cast<int64_t>(cache.size_bytes());
  if (cache.element_type() != ffi::DataType::U8 || page_bytes <= 0 || total % page_bytes != 0 ||
      out->size_bytes() != cache.size_bytes()) {
    return ffi::Error::InvalidArgument("jaxkv zero_pages: a flat uint8 cache of whole pages expected");
  }
  uint8_t* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), total);  // not aliased
  const int64_t num_pages = total / page_bytes;
  const int32_t* id = ids.typed_data();
  for (size_t i = 0; i < ids.element_count(); ++i)
    if (id[i] >= 0 && id[i] < num_pages) std::memset(dst + id[i] * page_bytes, 0, page_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvZeroPagesCpu, ZeroPagesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache [N * page_bytes] uint8
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page ids [K]
                                  .Ret<ffi::AnyBuffer>()          // the cache, aliased
                                  .Attr<int64_t>("page_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvWriteKvCpu, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache [N * page_bytes] uint8
                                  .Arg<ffi::AnyBuffer>()          // k [T, Hkv, D] cache dtype
                                  .Arg<ffi::AnyBuffer>()          // v [T, Hkv, D] cache dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]
                                  .Ret<ffi::AnyBuffer>()          // the cache, aliased
                                  .Attr<int32_t>("block_size"));

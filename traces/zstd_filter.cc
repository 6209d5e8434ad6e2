// traces/zstd_filter.cc — see zstd_filter.h.
#include "traces/zstd_filter.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "traces/h5.h"
#include "traces/trace_format.h"

namespace lockstep::traces {
namespace {

// Decompressed chunks above this are refused: HDF5 chunks are < 4 GiB, ours are ≤ a few MiB,
// and a corrupt frame header must not make us allocate terabytes.
constexpr unsigned long long kMaxChunkBytes = 1ull << 31;

size_t ZstdFilter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes, size_t* buf_size,
                  void** buf) {
  if (flags & H5Z_FLAG_REVERSE) {
    const unsigned long long size = ZSTD_getFrameContentSize(*buf, nbytes);
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN || size > kMaxChunkBytes) return 0;
    void* out = H5allocate_memory(size ? size : 1, false);
    if (!out) return 0;
    const size_t n = ZSTD_decompress(out, size, *buf, nbytes);
    if (ZSTD_isError(n) || n != size) {
      H5free_memory(out);
      return 0;
    }
    H5free_memory(*buf);
    *buf = out;
    *buf_size = size;
    return size;
  }
  int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : kDefaultZstdLevel;
  level = std::clamp(level, ZSTD_minCLevel(), ZSTD_maxCLevel());
  const size_t bound = ZSTD_compressBound(nbytes);
  void* out = H5allocate_memory(bound, false);
  if (!out) return 0;
  const size_t n = ZSTD_compress(out, bound, *buf, nbytes, level);
  if (ZSTD_isError(n)) {
    H5free_memory(out);
    return 0;
  }
  H5free_memory(*buf);
  *buf = out;
  *buf_size = bound;
  return n;
}

const H5Z_class2_t kZstdClass = {
    H5Z_CLASS_T_VERS,
    static_cast<H5Z_filter_t>(kZstdFilterId),
    1,  // encoder present
    1,  // decoder present
    "zstd (lockstep; 32015-compatible)",
    nullptr,  // can_apply
    nullptr,  // set_local
    ZstdFilter,
};

}  // namespace

const H5Z_class2_t* ZstdFilterClass() { return &kZstdClass; }

Status RegisterZstdFilter() {
  static std::once_flag once;
  static Status result;
  std::call_once(once, [] {
    h5::Quiet();
    if (H5Zregister(&kZstdClass) < 0) result = h5::Error("cannot register the zstd HDF5 filter (32015)");
  });
  return result;
}

void ShuffleBytes(const uint8_t* in, size_t bytes, size_t element_size, uint8_t* out) {
  if (element_size <= 1 || bytes <= element_size) {
    std::memcpy(out, in, bytes);
    return;
  }
  const size_t n = bytes / element_size;
  for (size_t j = 0; j < element_size; ++j) {
    uint8_t* dst = out + j * n;
    const uint8_t* src = in + j;
    for (size_t i = 0; i < n; ++i) dst[i] = src[i * element_size];
  }
  const size_t done = n * element_size;
  std::memcpy(out + done, in + done, bytes - done);
}

Status ShuffleCompressChunk(const uint8_t* chunk, size_t bytes, size_t element_size, int level,
                            std::vector<uint8_t>* out) {
  // Per thread, reused: the shuffle and compression buffers and zstd's context (a fresh
  // context per chunk allocated and zeroed its tables every time — page faults and memsets
  // that made the writer's workers the bottleneck of full capture). The frames are the same.
  struct Scratch {
    std::vector<uint8_t> shuffled, packed;
    ZSTD_CCtx* cctx = nullptr;
    ~Scratch() { ZSTD_freeCCtx(cctx); }
  };
  thread_local Scratch t;
  if (t.cctx == nullptr && (t.cctx = ZSTD_createCCtx()) == nullptr) return Status::Internal("zstd: no context");
  if (t.shuffled.size() < bytes) t.shuffled.resize(bytes);
  ShuffleBytes(chunk, bytes, element_size, t.shuffled.data());
  const size_t bound = ZSTD_compressBound(bytes);
  if (t.packed.size() < bound) t.packed.resize(bound);
  level = std::clamp(level, ZSTD_minCLevel(), ZSTD_maxCLevel());
  const size_t n = ZSTD_compressCCtx(t.cctx, t.packed.data(), bound, t.shuffled.data(), bytes, level);
  if (ZSTD_isError(n)) return Status::Internal(std::string("zstd: ") + ZSTD_getErrorName(n));
  out->assign(t.packed.data(), t.packed.data() + n);
  return Status::Ok();
}

Status DecompressUnshuffleChunk(const uint8_t* stored, size_t bytes, size_t element_size, size_t expect_bytes,
                                std::vector<uint8_t>* out) {
  const unsigned long long size = ZSTD_getFrameContentSize(stored, bytes);
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN || size != expect_bytes) {
    return Status::Corruption("chunk is not one zstd frame of " + std::to_string(expect_bytes) + " bytes");
  }
  std::vector<uint8_t> shuffled(expect_bytes);
  const size_t n = ZSTD_decompress(shuffled.data(), shuffled.size(), stored, bytes);
  if (ZSTD_isError(n) || n != expect_bytes) return Status::Corruption("chunk does not decompress");
  out->resize(expect_bytes);
  if (element_size <= 1 || expect_bytes <= element_size) {
    std::memcpy(out->data(), shuffled.data(), expect_bytes);
    return Status::Ok();
  }
  // Undo ShuffleBytes: byte j of element i is at j·n + i.
  const size_t count = expect_bytes / element_size;
  for (size_t j = 0; j < element_size; ++j) {
    const uint8_t* src = shuffled.data() + j * count;
    uint8_t* dst = out->data() + j;
    for (size_t i = 0; i < count; ++i) dst[i * element_size] = src[i];
  }
  const size_t done = count * element_size;
  std::memcpy(out->data() + done, shuffled.data() + done, expect_bytes - done);
  return Status::Ok();
}

}  // namespace lockstep::traces

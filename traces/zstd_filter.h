// traces/zstd_filter.h — the Zstandard HDF5 filter (registered ID 32015) and the chunk codec
// the trace writer's workers run.
//
// Filter semantics match the HDF Group's H5Zzstd (the one hdf5plugin ships): cd_values[0]
// is the level (absent → 3, clamped to zstd's range); each chunk is one frame from a
// one-shot ZSTD_compress, so the frame header carries the decompressed size, which the
// decoder relies on. The same code is built into lockstep (RegisterZstdFilter) and into
// the HDF5 plugin library hdf5-plugins/libh5zstd_lockstep.so (zstd_plugin.cc) that h5py
// and h5dump load through HDF5_PLUGIN_PATH.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <hdf5.h>

#include "base/status.h"

namespace lockstep::traces {

// The H5Z class of the filter (also what the plugin's H5PLget_plugin_info returns).
const H5Z_class2_t* ZstdFilterClass();

// The decoded size every chunk read on this thread must have while one is alive (0: any up
// to the filter's hard limit). The trace reader sets it around each H5Dread, so a frame that
// decodes to fewer or more bytes than the chunk holds is an error, not a short buffer HDF5
// would read past, or rows of zeros. Nests; thread-local.
class ExpectChunkBytes {
 public:
  explicit ExpectChunkBytes(size_t bytes);
  ~ExpectChunkBytes();
  ExpectChunkBytes(const ExpectChunkBytes&) = delete;
  ExpectChunkBytes& operator=(const ExpectChunkBytes&) = delete;

 private:
  size_t previous_;
};

// Registers the filter in this process once; later calls return the first result.
// Thread-safe.
Status RegisterZstdFilter();

// What H5Pset_shuffle then the zstd filter do to one chunk, done outside HDF5 so that
// worker threads can do it (the result goes to H5Dwrite_chunk with filter mask 0).
// `element_size` is the dataset type's size. Returns the compressed bytes in `out`.
Status ShuffleCompressChunk(const uint8_t* chunk, size_t bytes, size_t element_size, int level,
                            std::vector<uint8_t>* out);

// The inverse, for a chunk read from the file without HDF5 (the chunk directory of a trace
// whose index a crash tore): zstd-decompresses `bytes` of `stored` and unshuffles them;
// `out` receives exactly `expect_bytes` (the chunk's raw size) or an error.
Status DecompressUnshuffleChunk(const uint8_t* stored, size_t bytes, size_t element_size, size_t expect_bytes,
                                std::vector<uint8_t>* out);

// HDF5's byte shuffle (H5Zshuffle.c): byte j of element i goes to j·n + i; the bytes of
// a trailing partial element stay at the end. UnshuffleBytes undoes it. Exposed for tests.
void ShuffleBytes(const uint8_t* in, size_t bytes, size_t element_size, uint8_t* out);
void UnshuffleBytes(const uint8_t* in, size_t bytes, size_t element_size, uint8_t* out);

}  // namespace lockstep::traces

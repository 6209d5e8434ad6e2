// traces/zstd_plugin.cc — the HDF5 dynamic-plugin entry points, so that programs other than
// lockstep (h5py, h5dump, h5ls) decode traces: point HDF5_PLUGIN_PATH at the folder holding
// libh5zstd_lockstep.so (build/hdf5-plugins). Built only into that shared library.
#include <H5PLextern.h>

#include "traces/zstd_filter.h"

extern "C" {
__attribute__((visibility("default"))) H5PL_type_t H5PLget_plugin_type(void) { return H5PL_TYPE_FILTER; }
__attribute__((visibility("default"))) const void* H5PLget_plugin_info(void) {
  return lockstep::traces::ZstdFilterClass();
}
}

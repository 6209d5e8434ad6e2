// traces/trace_types.h — the HDF5 datatypes of the rows in trace_format.h, private to
// traces/. The compound types have exactly the C++ structs' layout (little-endian, same
// offsets), because the writer hands HDF5 raw chunk bytes with H5Dwrite_chunk.
#pragma once

#include "traces/h5.h"
#include "traces/trace_format.h"

namespace lockstep::traces {

h5::Hid SummaryType();
h5::Hid SamplingType();
h5::Hid StepType();
// The stored type of a tensor's values (bf16 → uint16, fp8_e4m3 → uint8).
hid_t ValueType(DType d);
Result<DType> ParseDType(const std::string& s);

}  // namespace lockstep::traces

// traces/trace_types.cc — see trace_types.h.
#include "traces/trace_types.h"

#include <cstddef>

namespace lockstep::traces {

#define LS_MEMBER(type, S, m, t) H5Tinsert(type, #m, offsetof(S, m), t)

h5::Hid SummaryType() {
  hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(SummaryRow));
  LS_MEMBER(t, SummaryRow, position, H5T_STD_I64LE);
  LS_MEMBER(t, SummaryRow, hash, H5T_STD_U64LE);
  LS_MEMBER(t, SummaryRow, request, H5T_STD_I32LE);
  LS_MEMBER(t, SummaryRow, step, H5T_STD_I32LE);
  LS_MEMBER(t, SummaryRow, nan_count, H5T_STD_U32LE);
  LS_MEMBER(t, SummaryRow, inf_count, H5T_STD_U32LE);
  LS_MEMBER(t, SummaryRow, rms, H5T_IEEE_F32LE);
  LS_MEMBER(t, SummaryRow, absmax, H5T_IEEE_F32LE);
  LS_MEMBER(t, SummaryRow, min, H5T_IEEE_F32LE);
  LS_MEMBER(t, SummaryRow, max, H5T_IEEE_F32LE);
  return h5::Hid(t);
}

h5::Hid SamplingType() {
  hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(SamplingRow));
  LS_MEMBER(t, SamplingRow, request, H5T_STD_I32LE);
  LS_MEMBER(t, SamplingRow, token, H5T_STD_I32LE);
  LS_MEMBER(t, SamplingRow, token_index, H5T_STD_I64LE);
  LS_MEMBER(t, SamplingRow, step, H5T_STD_I64LE);
  LS_MEMBER(t, SamplingRow, seed, H5T_STD_U64LE);
  LS_MEMBER(t, SamplingRow, counter, H5T_STD_U64LE);
  LS_MEMBER(t, SamplingRow, top_k, H5T_STD_I64LE);
  LS_MEMBER(t, SamplingRow, candidates, H5T_STD_I64LE);
  LS_MEMBER(t, SamplingRow, probability, H5T_IEEE_F64LE);
  LS_MEMBER(t, SamplingRow, uniform, H5T_IEEE_F64LE);
  LS_MEMBER(t, SamplingRow, temperature, H5T_IEEE_F64LE);
  LS_MEMBER(t, SamplingRow, top_p, H5T_IEEE_F64LE);
  LS_MEMBER(t, SamplingRow, min_p, H5T_IEEE_F64LE);
  LS_MEMBER(t, SamplingRow, batch_size, H5T_STD_I32LE);
  LS_MEMBER(t, SamplingRow, finished, H5T_STD_I32LE);
  LS_MEMBER(t, SamplingRow, sampled, H5T_STD_I32LE);
  LS_MEMBER(t, SamplingRow, forced, H5T_STD_I32LE);
  return h5::Hid(t);
}

h5::Hid StepType() {
  hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(StepRow));
  LS_MEMBER(t, StepRow, step, H5T_STD_I64LE);
  LS_MEMBER(t, StepRow, batch_size, H5T_STD_I32LE);
  LS_MEMBER(t, StepRow, tokens, H5T_STD_I32LE);
  LS_MEMBER(t, StepRow, wall_ns, H5T_STD_I64LE);
  LS_MEMBER(t, StepRow, stall_ns, H5T_STD_I64LE);
  return h5::Hid(t);
}

#undef LS_MEMBER

hid_t ValueType(DType d) {
  switch (d) {
    case DType::kF32: return H5T_IEEE_F32LE;
    case DType::kI32: return H5T_STD_I32LE;
    case DType::kBf16: return H5T_STD_U16LE;
    case DType::kFp8E4m3: return H5T_STD_U8LE;
    case DType::kU8: return H5T_STD_U8LE;
  }
  return H5T_STD_U8LE;
}

Result<DType> ParseDType(const std::string& s) {
  for (DType d : {DType::kF32, DType::kI32, DType::kBf16, DType::kFp8E4m3, DType::kU8}) {
    if (s == DTypeName(d)) return d;
  }
  return Status::Corruption("unknown dtype '" + s + "'");
}

}  // namespace lockstep::traces

// traces/row_summary.h — the per-row statistics and 64-bit content hash that every captured
// tensor row gets (SummaryRow in trace_format.h defines what each field means).
//
// Pure functions; thread-safe. Used by the recorder on the engine thread (so they must be
// cheap: one pass over the row) and by readers that verify a trace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "traces/trace_format.h"

namespace lockstep::traces {

// XXH3-64 (seed kHashSeed) of `bytes` bytes.
uint64_t ContentHash(const void* data, size_t bytes);

// Fills hash, nan_count, inf_count, rms, absmax, min, max of `row` (cols elements of
// `dtype`); leaves request, position and step alone. Element values: f32 and bf16 as the
// floats they encode, i32 and u8 as integers, fp8_e4m3 as the E4M3 value (without any scale).
void Summarize(DType dtype, const void* row, int64_t cols, SummaryRow* out);

// The k best entries of a logits row, highest first, ties to the lower id (the sampler's greedy
// rule), NaNs before everything in id order (a poisoned row shows them); k ≤ cols. And the
// row's logsumexp: m + ln Σ e^(x − m), m the row's largest non-NaN value, with e^ and ln
// lockstep's own (LseExp, LseLog: fixed IEEE operations, so the same bits on every machine
// and libm), the sum in double in eight lanes (element j into lane j mod 8, in row order; the
// lanes added ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))), rounded to float. What a full
// trace keeps of logits rows too wide to store whole.
void LogitsTopK(const float* row, int64_t cols, int64_t k, int32_t* ids, float* values, float* logsumexp);
// The logsumexp of the row at temperature T > 0, ln Σ e^(x / T): m/T + ln Σ e^((x − m)·(1/T)),
// with LogitsTopK's m, lanes, e^ and ln and 1/T in double — LogitsTopK's own bits at T = 1.
// What the sampler's total mass at the request's temperature is (`logits.logsumexp_t`).
float LogitsLogSumExp(const float* row, int64_t cols, double temperature);

// LogitsTopK's e^t and ln x (within 2 ulp of the exact values; tested against libm).
double LseExp(double t);
double LseLog(double x);

// Decoders used by Summarize (and by tests).
float Bf16ToFloat(uint16_t bits);
float Fp8E4m3ToFloat(uint8_t bits);

}  // namespace lockstep::traces

// tests/fuzz/fuzz_trace_edits.cc — the structure-aware trace fuzzer (issue 31): the input is
// not a file but a list of edits, applied through HDF5 to a valid trace, so every case is a
// well-formed HDF5 file whose values are hostile — counts, positions, request ids, layer
// indexes, attributes and shapes at their boundaries, rows moved, links renamed or deleted,
// chunks replaced by other bytes. Byte-level fuzzing (fuzz_trace_reader.cc) rarely gets past
// HDF5's own checks; this gets to lockstep's. Each case goes through TraceReader::Open, every
// read, and the trace comparison (diff) against the original and against itself: a crash, a
// sanitizer report, a leak or an error of more than one line is the finding.
//
// The base trace is written once per process by TraceWriter (2 requests, a full tap with
// values, a summary tap, a KV stream with its byte attributes, sampling rows matching the
// requests, steps), so the target needs no model and no file outside the build.
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "diff/trace_diff.h"
#include "traces/row_summary.h"
#include "traces/trace_pack.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"

namespace {

using namespace lockstep::traces;

std::string Base() {
  static const std::string path = [] {
    const std::string p = "/tmp/lockstep_fuzz_edits_base_" + std::to_string(getpid()) + ".h5";
    TraceWriterOptions o;
    o.target_chunk_bytes = 256;  // several chunks per table
    o.compression_threads = 0;
    o.batch_width = 2;
    auto w = TraceWriter::Create(p, o);
    if (!w.ok()) __builtin_trap();
    TraceWriter& tw = **w;
    (void)tw.SetMeta("model_fingerprint", "xxh3-64:0000000000000001");
    (void)tw.SetMeta("tokenizer_hash", "none");
    (void)tw.SetMeta("engine_options", "{\"page_size\": 64, \"kv_cache_tokens\": 4096, \"max_batch\": 2}");
    std::vector<int32_t> gen[2];
    for (int32_t id = 0; id < 2; ++id) {
      RequestRecord r;
      r.id = id;
      r.name = id ? "y" : "x";
      r.prompt = {5, 6, 7 + id};
      r.prompt_text = "abc";
      r.max_new_tokens = 6;
      r.seed = 3 + id;
      r.temperature = id * 0.5;
      (void)tw.AddRequest(r);
    }
    auto full = tw.DefineTensor({"taps/layers.0.x", DType::kF32, 6, true, {{"note", "full"}}, {}});
    auto summ = tw.DefineTensor({"taps/layers.1.resid_out", DType::kBf16, 6, false, {}, {}});
    auto kv = tw.DefineTensor({"kv/layers.0.latent", DType::kU8, 12, true, {}, {{"token_bytes", 12}, {"byte_offset", 0}}});
    if (!full.ok() || !summ.ok() || !kv.ok()) __builtin_trap();
    std::mt19937 rng(31);
    for (int64_t step = 0; step < 8; ++step) {
      for (int32_t id = 0; id < 2; ++id) {
        const int64_t n = step == 0 ? 3 : 1, pos0 = step == 0 ? 0 : 2 + step;
        for (int64_t k = 0; k < n; ++k) {
          float row[6];
          uint16_t brow[6];
          uint8_t krow[12];
          for (auto& v : row) v = static_cast<float>(rng() % 2000) / 100.0f - 10.0f;
          for (auto& v : brow) v = static_cast<uint16_t>(rng());
          for (auto& v : krow) v = static_cast<uint8_t>(rng());
          SummaryRow s;
          s.position = pos0 + k;
          s.request = id;
          s.step = static_cast<int32_t>(step);
          Summarize(DType::kF32, row, 6, &s);
          (void)tw.Append(*full, std::span(&s, 1), row);
          Summarize(DType::kBf16, brow, 6, &s);
          (void)tw.Append(*summ, std::span(&s, 1), nullptr);
          Summarize(DType::kU8, krow, 12, &s);
          (void)tw.Append(*kv, std::span(&s, 1), krow);
        }
        if (step < 6) {
          SamplingRow sr;
          sr.request = id;
          sr.token = static_cast<int32_t>(10 + step + id);
          sr.token_index = step;
          sr.step = step;
          sr.seed = 3 + id;
          sr.temperature = id * 0.5;
          gen[id].push_back(sr.token);
          (void)tw.AppendSampling(sr);
        }
      }
      StepRow st;
      st.step = step;
      st.batch_size = 2;
      const int64_t ids[] = {0, 1};
      (void)tw.AppendStep(st, ids);
      if (step % 3 == 0) (void)tw.Flush(step);
    }
    for (int32_t id = 0; id < 2; ++id) (void)tw.FinishRequest(id, gen[id], "gen", "length");
    if (!tw.Close().ok()) __builtin_trap();
    return p;
  }();
  return path;
}

std::vector<char> ReadAll(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), {});
}

// Reads the input as a stream of small numbers.
struct In {
  const uint8_t* p;
  size_t n;
  uint8_t U8() { return n ? (--n, *p++) : 0; }
  uint32_t U32() { return U8() | (U8() << 8) | (U8() << 16) | (static_cast<uint32_t>(U8()) << 24); }
  template <typename T, size_t N>
  const T& Pick(const T (&a)[N]) { return a[U8() % N]; }
};

const char* const kObjects[] = {".", "meta", "requests/0", "requests/1", "requests/0/final", "taps/layers.0.x",
                                "taps/layers.1.resid_out", "kv/layers.0.latent", "taps/layers.0.x/values",
                                "taps/layers.0.x/summary", "sampling", "steps", "step_batch"};
const char* const kAttrs[] = {"format_version", "complete", "flushed_steps", "cols", "has_values", "chunk_rows",
                              "max_new_tokens", "seed", "temperature", "top_k", "top_p", "min_p", "token_bytes",
                              "byte_offset", "dtype", "name", "finish_reason", "engine_options", "model_fingerprint",
                              "lockstep_trace", "recorded_with"};
const char* const kTables[] = {"taps/layers.0.x/summary", "taps/layers.1.resid_out/summary", "kv/layers.0.latent/summary",
                               "sampling", "steps", "step_batch", "taps/layers.0.x/values", "kv/layers.0.latent/values",
                               "requests/0/prompt", "requests/1/final/generated"};
const char* const kLinks[] = {"requests/0", "requests/1", "taps/layers.0.x", "taps/layers.1.resid_out",
                              "kv/layers.0.latent", "sampling", "steps", "step_batch", "meta", "requests/0/final",
                              "taps/layers.0.x/values", "taps/layers.0.x/summary", "requests/1/prompt_text"};
const char* const kNames[] = {"requests/7", "requests/-1", "requests/2147483648", "taps/layers.100000000000.x",
                              "taps/layers.-1.x", "taps/layers.65536.x", "taps/layers.0.x2", "kv/layers.0.latent_b",
                              "requests/x", "taps/layers.1.resid_out"};
const int64_t kInts[] = {0, 1, -1, 2, 7, 63, 4096, 4097, int64_t{1} << 22, (int64_t{1} << 22) + 1, int64_t{1} << 26,
                         (int64_t{1} << 31) - 1, int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 40, int64_t{1} << 53,
                         std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
const double kDoubles[] = {0.0, -0.0, 0.5, 1.0, 1.5, -1.0, 1e6, 1e300, -1e300, NAN, INFINITY, -INFINITY, 9.3e18, 4e-320};
const char* const kStrings[] = {"", "f32", "bf16", "i32", "u8", "fp8_e4m3", "f64", "lockstep trace", "{", "{}", "[]",
                                "{\"page_size\": 0}", "{\"kv_cache_tokens\": 1e300}", "{\"max_batch\": -1}",
                                "{\"page_size\": 1099511627776}", "length", "lockstep 9.9.9 (x)"};

void SetAttr(hid_t f, In& in) {
  const char* obj = in.Pick(kObjects);
  const char* name = in.Pick(kAttrs);
  hid_t o = H5Oopen(f, obj, H5P_DEFAULT);
  if (o < 0) return;
  if (H5Aexists(o, name) > 0) H5Adelete(o, name);
  const uint8_t kind = in.U8() % 4;
  hid_t space = H5Screate(H5S_SCALAR);
  if (kind == 0) {
    const int64_t v = in.Pick(kInts);
    hid_t a = H5Acreate2(o, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_INT64, &v), H5Aclose(a);
  } else if (kind == 1) {
    const double v = in.Pick(kDoubles);
    hid_t a = H5Acreate2(o, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_DOUBLE, &v), H5Aclose(a);
  } else if (kind == 2) {
    const std::string v = in.Pick(kStrings);
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, std::max<size_t>(v.size(), 1));
    hid_t a = H5Acreate2(o, name, t, space, H5P_DEFAULT, H5P_DEFAULT);
    std::string padded = v;
    padded.resize(std::max<size_t>(v.size(), 1), '\0');
    if (a >= 0) H5Awrite(a, t, padded.data()), H5Aclose(a);
    H5Tclose(t);
  } else {
    // An int array (format_version is [major, minor]).
    hsize_t dim = 1 + in.U8() % 3;
    hid_t s2 = H5Screate_simple(1, &dim, nullptr);
    int32_t v[3] = {static_cast<int32_t>(in.Pick(kInts)), static_cast<int32_t>(in.Pick(kInts)), 0};
    hid_t a = H5Acreate2(o, name, H5T_STD_I32LE, s2, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_INT32, v), H5Aclose(a);
    H5Sclose(s2);
  }
  H5Sclose(space);
  H5Oclose(o);
}

// Overwrites a few bytes of one row of a table with a hostile integer, through the filter
// (the chunk stays a valid frame of the right size: only lockstep's checks can catch it).
void PatchRow(hid_t f, In& in) {
  hid_t d = H5Dopen2(f, in.Pick(kTables), H5P_DEFAULT);
  if (d < 0) return;
  hid_t t = H5Dget_type(d), s = H5Dget_space(d);
  hsize_t dims[2] = {0, 1};
  const int rank = H5Sget_simple_extent_dims(s, dims, nullptr);
  const size_t row = H5Tget_size(t) * (rank == 2 ? dims[1] : 1);
  if (rank >= 1 && dims[0] > 0 && row > 0 && dims[0] * row < (8u << 20)) {
    std::vector<uint8_t> all(dims[0] * row);
    if (H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, all.data()) >= 0) {
      const size_t r = in.U32() % dims[0];
      const size_t at = (in.U8() * 4u) % row;  // field boundaries are multiples of 4
      const int64_t v = in.Pick(kInts);
      const size_t width = std::min<size_t>(in.U8() % 2 ? 8 : 4, row - at);
      std::memcpy(all.data() + r * row + at, &v, width);
      if (in.U8() % 4 == 0 && dims[0] > 1) {  // and move a row onto another
        const size_t r2 = in.U32() % dims[0];
        std::memcpy(all.data() + r2 * row, all.data() + r * row, row);
      }
      H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, all.data());
    }
  }
  H5Tclose(t);
  H5Sclose(s);
  H5Dclose(d);
}

void Resize(hid_t f, In& in) {
  hid_t d = H5Dopen2(f, in.Pick(kTables), H5P_DEFAULT);
  if (d < 0) return;
  hid_t s = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  const int rank = H5Sget_simple_extent_dims(s, dims, nullptr);
  const int64_t choice[] = {0, 1, -1, 2, 100, int64_t{1} << 20, int64_t{1} << 40};
  const int64_t c = in.Pick(choice);
  const hsize_t before = dims[0];
  dims[0] = c < 0 ? (dims[0] > 0 ? dims[0] - 1 : 0) : (c == 2 ? dims[0] * 2 : static_cast<hsize_t>(c));
  // Shrinking a dataset already grown past 2^20 rows makes libhdf5 walk every chunk slot of the
  // old extent (H5D__chunk_prune_by_extent: minutes at 2^40) — the harness's own edit, not a
  // read lockstep does; such an edit is skipped.
  const bool slow_prune = before > (hsize_t{1} << 20) && dims[0] < before;
  if (rank >= 1 && !slow_prune) H5Dset_extent(d, dims);
  H5Sclose(s);
  H5Dclose(d);
}

// Replaces a stored chunk with bytes of the input (a short, long or invalid frame), or stores
// it unfiltered.
void RawChunk(hid_t f, In& in) {
  hid_t d = H5Dopen2(f, in.Pick(kTables), H5P_DEFAULT);
  if (d < 0) return;
  hid_t s = H5Dget_space(d);
  const int rank = H5Sget_simple_extent_ndims(s);
  hsize_t off[2] = {0, 0};
  std::vector<uint8_t> bytes(1 + in.U8() % 200);
  for (auto& b : bytes) b = in.U8();
  if (in.U8() % 2) std::memcpy(bytes.data(), "\x28\xb5\x2f\xfd", std::min<size_t>(4, bytes.size()));  // zstd magic
  const uint32_t mask = in.U8() % 3 == 0 ? 0x3 : 0;
  if (rank >= 1) H5Dwrite_chunk(d, H5P_DEFAULT, mask, off, bytes.size(), bytes.data());
  H5Sclose(s);
  H5Dclose(d);
}

// A dataset declared far larger than what stores it (an unallocated prompt of 2^26 tokens, a
// 1 GiB fixed string): a reader must not allocate what a header claims.
void Declare(hid_t f, In& in) {
  const char* const where[] = {"requests/0/prompt", "requests/1/prompt_text", "requests/0/final/generated",
                               "requests/1/final/generated_text"};
  const char* p = in.Pick(where);
  H5Ldelete(f, p, H5P_DEFAULT);
  hid_t space, type, dcpl = H5Pcreate(H5P_DATASET_CREATE);
  if (std::strstr(p, "text")) {
    space = H5Screate(H5S_SCALAR);
    type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, in.U8() % 2 ? (size_t{1} << 30) : 1 + in.U8());
  } else {
    const hsize_t n = in.U8() % 2 ? (hsize_t{1} << 26) : in.U8();
    const hsize_t chunk = std::max<hsize_t>(1, std::min<hsize_t>(n, 1 << 16));
    space = H5Screate_simple(1, &n, nullptr);
    type = H5Tcopy(in.U8() % 4 ? H5T_STD_I32LE : H5T_IEEE_F64LE);
    if (n > 0) H5Pset_chunk(dcpl, 1, &chunk);
  }
  hid_t d = H5Dcreate2(f, p, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  if (d >= 0) H5Dclose(d);
  H5Pclose(dcpl);
  H5Tclose(type);
  H5Sclose(space);
}

void Apply(const std::string& path, In& in) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) return;
  // After a raw chunk, no edit reads rows or resizes: HDF5 1.10 itself copies a whole chunk out
  // of a shorter unfiltered one (the reader refuses those; this harness would trip over it first).
  bool raw = false;
  for (int edits = 0; edits < 8 && in.n > 0; ++edits) {
    switch (in.U8() % 7) {
      case 0: SetAttr(f, in); break;
      case 1:
        if (!raw) PatchRow(f, in);
        break;
      case 2:
        if (!raw) Resize(f, in);  // shrinking a table reads its last chunk too
        break;
      case 3:
        RawChunk(f, in);
        raw = true;
        break;
      case 4: H5Ldelete(f, in.Pick(kLinks), H5P_DEFAULT); break;
      case 5: {
        const char* from = in.Pick(kLinks);
        H5Lmove(f, from, f, in.Pick(kNames), H5P_DEFAULT, H5P_DEFAULT);
        break;
      }
      case 6: Declare(f, in); break;
    }
  }
  H5Fclose(f);
}

void Exercise(const TraceReader& base, const TraceReader& r) {
  (void)r.ReadSampling();
  (void)r.ReadSteps();
  int64_t width = 0;
  (void)r.ReadStepBatch(&width);
  for (const auto& t : r.tensors()) {
    (void)r.ReadSummary(t);
    if (t.has_values) (void)r.ReadValues(t, 0, std::min<int64_t>(t.rows, 64));
  }
  (void)ContentHashes(r);
  if (auto p = ReadPack(r); p.ok()) (void)CheckManifest(r, *p);
  lockstep::diff::DiffOptions o;
  o.allow_model_mismatch = true;
  (void)lockstep::diff::CompareTraces(base, r, o);
  (void)lockstep::diff::CompareTraces(r, r, o);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<char> base_bytes = ReadAll(Base());
  static auto base = TraceReader::Open(Base());
  if (!base.ok()) __builtin_trap();
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  static const std::string path = "/tmp/lockstep_fuzz_edits_" + std::to_string(getpid()) + ".h5";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(base_bytes.data(), static_cast<std::streamsize>(base_bytes.size()));
  }
  In in{data, size};
  Apply(path, in);
  auto r = TraceReader::Open(path);
  if (r.ok()) {
    Exercise(**base, **r);
  } else if (r.status().message().find('\n') != std::string::npos) {
    __builtin_trap();  // errors are one line
  }
  return 0;
}

// tests/traces/trace_bad_input_test.cc — what the reader and `lockstep inspect` do with files
// that are not good traces: a truncated trace, a text file, a newer format version, missing
// datasets and attributes, a dataset whose shape claims petabytes. Each must give one line
// naming the file (and the field), a non-zero exit from inspect, and no crash.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "traces/row_summary.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"

namespace lockstep::traces {
namespace {

namespace fs = std::filesystem;

// One folder per test: CTest runs the tests of this file in parallel processes.
fs::path Dir() {
  fs::path d = fs::temp_directory_path() / "lockstep_bad_input_test" /
               ::testing::UnitTest::GetInstance()->current_test_info()->name();
  fs::create_directories(d);
  return d;
}

// A small good trace: one request, one full tensor of 40 rows, two flushes.
fs::path GoodTrace() {
  const fs::path p = Dir() / "good.h5";
  TraceWriterOptions o;
  o.target_chunk_bytes = 512;
  auto w = TraceWriter::Create(p, o);
  EXPECT_TRUE(w.ok()) << w.status().message();
  RequestRecord r;
  r.prompt = {1, 2, 3};
  EXPECT_TRUE((*w)->AddRequest(r).ok());
  auto t = (*w)->DefineTensor({"taps/x", DType::kF32, 8, true, {}});
  std::mt19937 rng(3);
  for (int i = 0; i < 40; ++i) {
    float row[8];
    for (float& v : row) v = static_cast<float>(rng() % 1000) / 7.0f;
    SummaryRow s;
    s.position = i;
    Summarize(DType::kF32, row, 8, &s);
    EXPECT_TRUE((*w)->Append(*t, std::span(&s, 1), row).ok());
    if (i % 16 == 0) EXPECT_TRUE((*w)->Flush(i).ok());
  }
  EXPECT_TRUE((*w)->Close().ok());
  return p;
}

fs::path CopyOf(const fs::path& src, const std::string& name) {
  const fs::path p = Dir() / name;
  fs::copy_file(src, p, fs::copy_options::overwrite_existing);
  return p;
}

// Edits a copy with the HDF5 C API.
void Edit(const fs::path& p, const std::function<void(hid_t)>& fn) {
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  fn(f);
  ASSERT_GE(H5Fclose(f), 0);
}

// Runs `lockstep inspect FILE`; returns its exit code and stderr.
std::pair<int, std::string> Inspect(const fs::path& p) {
  const fs::path err = Dir() / "stderr.txt";
  const std::string cmd = std::string(LOCKSTEP_BINARY) + " inspect '" + p.string() + "' >/dev/null 2>'" + err.string() + "'";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(err);
  std::string s((std::istreambuf_iterator<char>(in)), {});
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, s};
}

void ExpectRefused(const fs::path& p, const std::string& needle) {
  auto r = TraceReader::Open(p);
  ASSERT_FALSE(r.ok()) << p;
  const std::string& m = r.status().message();
  EXPECT_NE(m.find(p.string()), std::string::npos) << m;
  EXPECT_NE(m.find(needle), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  auto [rc, err] = Inspect(p);
  EXPECT_NE(rc, 0) << err;
  EXPECT_LE(rc, 2) << "crashed? " << err;  // 1 or 2, never a signal
  ASSERT_FALSE(err.empty());
  EXPECT_EQ(err.find('\n'), err.size() - 1) << "more than one line: " << err;
  EXPECT_EQ(err.rfind("lockstep: ", 0), 0u) << err;
}

TEST(TraceBadInput, GoodTraceOpensAndInspects) {
  const fs::path p = GoodTrace();
  auto r = TraceReader::Open(p);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)->FindTensor("x")->rows, 40);
  EXPECT_EQ(Inspect(p).first, 0);
}

TEST(TraceBadInput, TruncatedFile) {
  const fs::path p = CopyOf(GoodTrace(), "truncated.h5");
  fs::resize_file(p, fs::file_size(p) / 2);
  ExpectRefused(p, "truncated");
}

TEST(TraceBadInput, NotHdf5) {
  const fs::path p = Dir() / "text.h5";
  std::ofstream(p) << "this is not a trace\n";
  ExpectRefused(p, "not an HDF5 file");
  const fs::path empty = Dir() / "empty.h5";
  std::ofstream(empty).flush();
  ExpectRefused(empty, "not an HDF5 file");
  ExpectRefused(Dir() / "does-not-exist.h5", "no such trace file");
}

TEST(TraceBadInput, HdfButNotATrace) {
  const fs::path p = Dir() / "plain.h5";
  hid_t f = H5Fcreate(p.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  H5Fclose(f);
  ExpectRefused(p, "not a lockstep trace");
}

TEST(TraceBadInput, NewerFormatVersion) {
  const fs::path p = CopyOf(GoodTrace(), "newer.h5");
  Edit(p, [](hid_t f) {
    hid_t a = H5Aopen(f, kAttrFormatVersion, H5P_DEFAULT);
    const int32_t v[2] = {kFormatMajor + 1, 0};
    H5Awrite(a, H5T_NATIVE_INT32, v);
    H5Aclose(a);
  });
  ExpectRefused(p, "is newer than this lockstep reads");
}

TEST(TraceBadInput, MissingDatasetsAndAttributes) {
  const fs::path a = CopyOf(GoodTrace(), "no_summary.h5");
  Edit(a, [](hid_t f) { H5Ldelete(f, "taps/x/summary", H5P_DEFAULT); });
  ExpectRefused(a, "taps/x/summary");
  const fs::path b = CopyOf(GoodTrace(), "no_sampling.h5");
  Edit(b, [](hid_t f) { H5Ldelete(f, kSamplingTable, H5P_DEFAULT); });
  ExpectRefused(b, "sampling");
  const fs::path c = CopyOf(GoodTrace(), "no_dtype.h5");
  Edit(c, [](hid_t f) { H5Adelete_by_name(f, "taps/x", kAttrDType, H5P_DEFAULT); });
  ExpectRefused(c, "dtype");
  const fs::path d = CopyOf(GoodTrace(), "no_prompt.h5");
  Edit(d, [](hid_t f) { H5Ldelete(f, "requests/0/prompt", H5P_DEFAULT); });
  ExpectRefused(d, "requests/0/prompt");
}

TEST(TraceBadInput, ShapeClaimingPetabytes) {
  const fs::path p = CopyOf(GoodTrace(), "petabytes.h5");
  Edit(p, [](hid_t f) {
    hid_t d = H5Dopen2(f, "taps/x/values", H5P_DEFAULT);
    const hsize_t dims[2] = {hsize_t{1} << 47, 8};  // 2^47 rows × 32 bytes = 4 PiB
    ASSERT_GE(H5Dset_extent(d, dims), 0);
    H5Dclose(d);
  });
  ExpectRefused(p, "claims");
}

TEST(TraceBadInput, WrongElementType) {
  const fs::path p = CopyOf(GoodTrace(), "wrong_type.h5");
  Edit(p, [](hid_t f) {
    H5Ldelete(f, "taps/x/values", H5P_DEFAULT);
    const hsize_t dims[2] = {40, 8};
    hid_t s = H5Screate_simple(2, dims, nullptr);
    hid_t d = H5Dcreate2(f, "taps/x/values", H5T_IEEE_F64LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(d);
    H5Sclose(s);
  });
  ExpectRefused(p, "taps/x/values");
}

}  // namespace
}  // namespace lockstep::traces

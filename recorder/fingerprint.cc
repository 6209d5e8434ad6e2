// recorder/fingerprint.cc — see fingerprint.h.
#include "recorder/fingerprint.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

namespace lockstep::recorder {
namespace fs = std::filesystem;
namespace {

std::string Hex(uint64_t h) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "xxh3-64:%016llx", static_cast<unsigned long long>(h));
  return buf;
}

Status HashInto(XXH3_state_t* st, const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return Status::NotFound(file.string() + ": cannot open for fingerprinting");
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    XXH3_64bits_update(st, buf.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) return Status::IoError(file.string() + ": read error while fingerprinting");
  return Status::Ok();
}

}  // namespace

Result<std::string> FileFingerprint(const fs::path& file) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(st.get());
  LS_RETURN_IF_ERROR(HashInto(st.get(), file));
  return Hex(XXH3_64bits_digest(st.get()));
}

Result<std::string> ModelFingerprint(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".safetensors") files.push_back(e.path());
  }
  if (ec) return Status::IoError(dir.string() + ": cannot list: " + ec.message());
  if (files.empty()) return Status::NotFound(dir.string() + ": no *.safetensors to fingerprint");
  std::sort(files.begin(), files.end());
  nlohmann::json stamp = nlohmann::json::array();
  for (const auto& f : files) {
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    stamp.push_back({f.filename().string(), static_cast<int64_t>(fs::file_size(f, ec)), static_cast<int64_t>(mtime)});
  }
  const fs::path cache = dir / kFingerprintCacheFile;
  {
    std::ifstream in(cache);
    if (in) {
      nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.value("files", nlohmann::json()) == stamp &&
          j.contains("fingerprint") && j["fingerprint"].is_string()) {
        return j["fingerprint"].get<std::string>();
      }
    }
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(st.get());
  for (const auto& f : files) LS_RETURN_IF_ERROR(HashInto(st.get(), f));
  const std::string fp = Hex(XXH3_64bits_digest(st.get()));
  std::ofstream out(cache);  // best effort: a read-only model directory just has no cache
  if (out) out << nlohmann::json{{"files", stamp}, {"fingerprint", fp}}.dump() << "\n";
  return fp;
}

}  // namespace lockstep::recorder

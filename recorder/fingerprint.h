// recorder/fingerprint.h — content hashes that identify a model in a trace's meta.
//
// The model fingerprint is XXH3-64 (seed 0) over the bytes of every *.safetensors file of
// the model directory, in file-name order, as one stream: "xxh3-64:<16 hex digits>". Hashing
// gigabytes takes seconds, so the result is cached beside the model in
// .lockstep-fingerprint.json with each file's size and modification time, and recomputed
// when any of them changes (or the cache cannot be read). A directory we cannot write to
// simply gets no cache.
#pragma once

#include <filesystem>
#include <string>

#include "base/status.h"

namespace lockstep::recorder {

inline constexpr char kFingerprintCacheFile[] = ".lockstep-fingerprint.json";

Result<std::string> ModelFingerprint(const std::filesystem::path& model_dir);
// "xxh3-64:<hex>" of one file's bytes.
Result<std::string> FileFingerprint(const std::filesystem::path& file);

}  // namespace lockstep::recorder

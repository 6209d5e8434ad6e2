// engine/safetensors.h — memory-mapped, validated reading of Hugging Face safetensors files,
// single-file or sharded (`model.safetensors.index.json`).
//
// Every offset and shape in a header is checked against the file before any byte of tensor
// data is touched, so a lying or truncated file yields a one-line error naming the file and
// the tensor, never an out-of-bounds read. Tensor data stays in the mapping (read-only,
// MAP_PRIVATE: resident only as far as it is read): a TensorView of an opened file holds a
// reference to its mapping (`mapping`), so its `data` stays valid as long as the view — or a
// copy of that reference — lives.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::engine {

// kF8E8M0: unsigned power-of-two exponents (MXFP4 block scales, DeepSeek-V4's routed experts).
enum class DType { kF32, kF16, kBF16, kF8E4M3, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E8M0 };

std::string_view DTypeName(DType d);  // the safetensors spelling: "F32", "BF16", "F8_E4M3", …
size_t DTypeSize(DType d);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; not necessarily aligned
  size_t nbytes = 0;
  std::string file;  // the file name, for error messages
  // Keeps `data` mapped (the file's MappedFile); null for ParseHeader's views of caller-owned bytes.
  std::shared_ptr<const void> mapping;

  int64_t numel() const;
  std::string ShapeString() const;  // "[64, 128]"
};

// A read-only mapping of one file.
class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> Open(const std::filesystem::path& path);
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  // Parses and validates a header against `file_size` bytes of file; exposed for the fuzzer.
  // `file_bytes` must hold the whole file (header and data).
  static Result<std::map<std::string, TensorView>> ParseHeader(const uint8_t* file_bytes, size_t file_size,
                                                               const std::string& file_name);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  size_t file_size() const { return file_->size(); }  // bytes mapped: header and data

 private:
  std::shared_ptr<const MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a model directory: `model.safetensors`, or the shards that
// `model.safetensors.index.json` names (every shard is opened and validated).
class Checkpoint {
 public:
  static Result<std::unique_ptr<Checkpoint>> Open(const std::filesystem::path& model_dir);

  const TensorView* Find(std::string_view name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  std::vector<std::string> files() const;
  uint64_t total_bytes() const;  // tensor data bytes
  uint64_t file_bytes() const;   // the files' sizes: what is mapped

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, TensorView> tensors_;
  std::vector<std::string> file_names_;
};

}  // namespace lockstep::engine

// engine/safetensors.cc — see safetensors.h. Format: 8-byte little-endian header length N,
// N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {…}},
// then the data; offsets are relative to the end of the header.
#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace lockstep::engine {
namespace {

using json = nlohmann::json;

// Headers of real checkpoints are < 10 MB (DeepSeek-V3 shards: ~100 KB); 100 MB is the cap
// the reference implementation uses too.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

bool ParseDType(std::string_view s, DType* out) {
  static const std::pair<std::string_view, DType> kTable[] = {
      {"F32", DType::kF32}, {"F16", DType::kF16},   {"BF16", DType::kBF16}, {"F8_E4M3", DType::kF8E4M3},
      {"F64", DType::kF64}, {"I64", DType::kI64},   {"I32", DType::kI32},   {"I16", DType::kI16},
      {"I8", DType::kI8},   {"U8", DType::kU8},     {"BOOL", DType::kBool}, {"F8_E8M0", DType::kF8E8M0}};
  for (const auto& [name, d] : kTable) {
    if (s == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

}  // namespace

std::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF64: return "F64";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
    case DType::kF8E8M0: return "F8_E8M0";
  }
  return "?";
}

size_t DTypeSize(DType d) {
  switch (d) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kF8E4M3: case DType::kI8: case DType::kU8: case DType::kBool: case DType::kF8E8M0: return 1;
  }
  return 1;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::ShapeString() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Result<std::unique_ptr<MappedFile>> MappedFile::Open(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError(path.string() + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return Status::IoError(path.string() + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::IoError(path.string() + ": not a regular file");
  }
  std::unique_ptr<MappedFile> f(new MappedFile());
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return Status::IoError(path.string() + ": mmap failed: " + std::strerror(e));
    }
    f->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Result<std::map<std::string, TensorView>> SafetensorsFile::ParseHeader(const uint8_t* bytes, size_t file_size,
                                                                       const std::string& file) {
  if (file_size < 8) {
    return Status::Corruption(file + ": truncated: " + std::to_string(file_size) +
                              " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes) {
    return Status::Corruption(file + ": header length " + std::to_string(n) + " exceeds the 100 MB limit");
  }
  if (n > file_size - 8) {
    return Status::Corruption(file + ": truncated: header claims " + std::to_string(n) + " bytes but the file has " +
                              std::to_string(file_size - 8) + " after the length field");
  }
  const uint64_t data_size = file_size - 8 - n;
  const uint8_t* data = bytes + 8 + n;
  json header = json::parse(bytes + 8, bytes + 8 + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Status::Corruption(file + ": header is not valid JSON");
  if (!header.is_object()) return Status::Corruption(file + ": header is not a JSON object");

  std::map<std::string, TensorView> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const std::string where = file + ": tensor '" + name + "'";
    const json& e = it.value();
    if (!e.is_object()) return Status::Corruption(where + ": entry is not an object");
    auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string()) return Status::Corruption(where + ": missing field 'dtype'");
    TensorView t;
    t.name = name;
    t.file = file;
    if (!ParseDType(dt->get<std::string>(), &t.dtype)) {
      return Status::Unsupported(where + ": unsupported dtype '" + dt->get<std::string>() + "'");
    }
    auto sh = e.find("shape");
    if (sh == e.end() || !sh->is_array()) return Status::Corruption(where + ": missing field 'shape'");
    if (sh->size() > 8) return Status::Corruption(where + ": shape has " + std::to_string(sh->size()) + " dims");
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        return Status::Corruption(where + ": shape holds a non-integer or negative dimension");
      }
      uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > std::numeric_limits<uint64_t>::max() / v) {
        return Status::Corruption(where + ": shape overflows");
      }
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    auto off = e.find("data_offsets");
    if (off == e.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return Status::Corruption(where + ": 'data_offsets' must be two non-negative integers");
    }
    uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end) return Status::Corruption(where + ": data_offsets begin > end");
    if (end > data_size) {
      return Status::Corruption(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") end past the data (" + std::to_string(data_size) + " bytes; file truncated?)");
    }
    const uint64_t esize = DTypeSize(t.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / esize || numel * esize != end - begin) {
      return Status::Corruption(where + ": shape " + t.ShapeString() + " × " + std::string(DTypeName(t.dtype)) +
                                " needs " + std::to_string(numel * esize) + " bytes but data_offsets span " +
                                std::to_string(end - begin));
    }
    t.data = data + begin;
    t.nbytes = end - begin;
    out.emplace(name, std::move(t));
  }
  return out;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::filesystem::path& path) {
  LS_ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(path));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  LS_ASSIGN_OR_RETURN(f->tensors_, ParseHeader(mapped->data(), mapped->size(), path.filename().string()));
  f->file_ = std::move(mapped);
  for (auto& [_, t] : f->tensors_) t.mapping = f->file_;
  return f;
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::filesystem::path& dir) {
  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  const auto single = dir / "model.safetensors";
  const auto index = dir / "model.safetensors.index.json";
  std::vector<std::filesystem::path> shard_paths;
  if (std::filesystem::exists(index)) {
    std::ifstream in(index);
    json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::Corruption(index.filename().string() + ": not valid JSON");
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) {
      return Status::Corruption(index.filename().string() + ": missing field 'weight_map'");
    }
    std::set<std::string> names;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string()) {
        return Status::Corruption(index.filename().string() + ": weight_map['" + it.key() + "'] is not a string");
      }
      std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard == ".." || shard.empty()) {
        return Status::Corruption(index.filename().string() + ": weight_map['" + it.key() +
                                  "'] names a file outside the model directory: '" + shard + "'");
      }
      names.insert(shard);
    }
    for (const auto& s : names) shard_paths.push_back(dir / s);
    // Every tensor the index names must be in the shard it names.
    std::vector<std::pair<std::string, std::string>> expected;
    for (auto it = wm->begin(); it != wm->end(); ++it) expected.emplace_back(it.key(), it.value().get<std::string>());
    for (const auto& p : shard_paths) {
      if (!std::filesystem::exists(p)) {
        return Status::NotFound(index.filename().string() + ": shard '" + p.filename().string() + "' is missing");
      }
      LS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(p));
      for (const auto& [n, t] : f->tensors()) {
        if (!ck->tensors_.emplace(n, t).second) {
          return Status::Corruption(p.filename().string() + ": tensor '" + n + "' also appears in another shard");
        }
      }
      ck->file_names_.push_back(p.filename().string());
      ck->shards_.push_back(std::move(f));
    }
    for (const auto& [n, shard] : expected) {
      auto it = ck->tensors_.find(n);
      if (it == ck->tensors_.end() || it->second.file != shard) {
        return Status::Corruption(index.filename().string() + ": tensor '" + n + "' is not in shard '" + shard + "'");
      }
    }
  } else if (std::filesystem::exists(single)) {
    LS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(single));
    ck->tensors_ = f->tensors();
    ck->file_names_.push_back("model.safetensors");
    ck->shards_.push_back(std::move(f));
  } else {
    return Status::NotFound(dir.string() + ": no model.safetensors or model.safetensors.index.json");
  }
  return ck;
}

const TensorView* Checkpoint::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> Checkpoint::files() const { return file_names_; }

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [_, t] : tensors_) n += t.nbytes;
  return n;
}

uint64_t Checkpoint::file_bytes() const {
  uint64_t n = 0;
  for (const auto& s : shards_) n += s->file_size();
  return n;
}

}  // namespace lockstep::engine

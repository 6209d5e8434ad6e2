// traces/h5.h — a thin RAII layer over the HDF5 C API, private to traces/.
//
// Hid owns one HDF5 identifier and closes it with the matching H5?close. Helpers return
// Status with the failing call, the object's path and HDF5's innermost error message,
// instead of HDF5's habit of printing its error stack to stderr (Quiet() turns that off for
// the calling thread: HDF5's error stack is per thread in a thread-safe build).
//
// The HDF5 library here is a thread-safe build: every call takes one global lock. Only the
// trace writer thread and readers call it; the engine thread never does.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace lockstep::traces::h5 {

class Hid {
 public:
  Hid() = default;
  explicit Hid(hid_t id) : id_(id) {}
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      Reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  ~Hid() { Reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports a failure (for files, whose close flushes).
  Status Close();
  void Reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// Silences HDF5's automatic error printing on the calling thread.
void Quiet();
// HDF5's innermost error message on this thread's stack ("" when empty), then clears it.
std::string LastError();
// Status for a failed call: "<what>: <HDF5's message>".
Status Error(const std::string& what);

// Creation property list of class `cls` (H5P_DATASET_CREATE, H5P_GROUP_CREATE) for our
// objects: without modification times, so files are byte-for-byte reproducible.
Hid CreationProps(hid_t cls);

bool Exists(hid_t loc, const std::string& path);
Result<Hid> OpenGroup(hid_t loc, const std::string& path);
Result<Hid> CreateGroup(hid_t loc, const std::string& path);
Result<Hid> OpenDataset(hid_t loc, const std::string& path);

// Attributes. Strings are fixed-length UTF-8, null-padded, stored inline (h5py reads them
// as bytes; .decode()). Attributes live in the object header, so a string attribute holds
// at most kMaxStringAttr bytes; longer texts go to string datasets.
inline constexpr size_t kMaxStringAttr = 48 << 10;
Status WriteAttr(hid_t obj, const std::string& name, const std::string& value);
Status WriteAttr(hid_t obj, const std::string& name, int64_t value);
Status WriteAttr(hid_t obj, const std::string& name, double value);
Status WriteAttrU8(hid_t obj, const std::string& name, uint8_t value);
Status WriteAttrI32s(hid_t obj, const std::string& name, const std::vector<int32_t>& values);
bool HasAttr(hid_t obj, const std::string& name);
// A scalar fixed-length string dataset (for texts of any length).
Status WriteStringDataset(hid_t loc, const std::string& name, const std::string& value);
Result<std::string> ReadStringDataset(hid_t loc, const std::string& path, size_t max_bytes);
Result<std::string> ReadStringAttr(hid_t obj, const std::string& name);
Result<int64_t> ReadIntAttr(hid_t obj, const std::string& name);
Result<double> ReadDoubleAttr(hid_t obj, const std::string& name);
Result<std::vector<int64_t>> ReadIntsAttr(hid_t obj, const std::string& name, size_t max_count);
// All attribute names of an object.
Result<std::vector<std::string>> AttrNames(hid_t obj);
// Names of the links in a group, in name order.
Result<std::vector<std::string>> LinkNames(hid_t group);

// Dataset shape: dims (at most `max_rank`).
Result<std::vector<hsize_t>> Dims(hid_t dataset, int max_rank);

}  // namespace lockstep::traces::h5

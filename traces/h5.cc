// traces/h5.cc — see h5.h.
#include "traces/h5.h"

#include <algorithm>

namespace lockstep::traces::h5 {

void Hid::Reset() {
  if (id_ >= 0) {
    // Reset runs from destructors and reassignments, which have no caller to report to; the id
    // is released whether or not HDF5's close succeeds. Code that needs the outcome (a file,
    // whose close flushes) calls Close() itself.
    (void)Close();
  }
}

Status Hid::Close() {
  if (id_ < 0) return Status::Ok();
  const hid_t id = std::exchange(id_, H5I_INVALID_HID);
  herr_t rc = 0;
  switch (H5Iget_type(id)) {
    case H5I_FILE: rc = H5Fclose(id); break;
    case H5I_GROUP: rc = H5Gclose(id); break;
    case H5I_DATASET: rc = H5Dclose(id); break;
    case H5I_DATASPACE: rc = H5Sclose(id); break;
    case H5I_DATATYPE: rc = H5Tclose(id); break;
    case H5I_ATTR: rc = H5Aclose(id); break;
    case H5I_GENPROP_LST: rc = H5Pclose(id); break;
    default: rc = H5Idec_ref(id) < 0 ? -1 : 0; break;
  }
  return rc < 0 ? Error("close") : Status::Ok();
}

void Quiet() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

std::string LastError() {
  std::string msg;
  // Walking upward visits the innermost error (where it was detected) first.
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* out = static_cast<std::string*>(data);
        if (n == 0 && e->desc) *out = e->desc;
        return 0;
      },
      &msg);
  H5Eclear2(H5E_DEFAULT);
  // HDF5 messages sometimes span lines; a Status is one line.
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  // I/O failures come as "file write failed: time = …, filename = …, errno = 28, error
  // message = 'No space left on device', …": keep what a user can act on.
  const size_t em = msg.find("error message = '");
  if (em != std::string::npos) {
    const size_t b = em + 17, e = msg.find('\'', b);
    const size_t colon = msg.find(':');
    msg = msg.substr(0, colon) + ": " + msg.substr(b, e == std::string::npos ? std::string::npos : e - b);
  }
  return msg;
}

Status Error(const std::string& what) {
  const std::string e = LastError();
  return Status::IoError(e.empty() ? what : what + ": " + e);
}

bool Exists(hid_t loc, const std::string& path) {
  // H5Lexists fails (not false) when an intermediate group is missing; walk the path.
  size_t pos = 0;
  while (true) {
    const size_t slash = path.find('/', pos);
    const std::string prefix = path.substr(0, slash);
    if (H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    if (slash == std::string::npos) return true;
    pos = slash + 1;
  }
}

Result<Hid> OpenGroup(hid_t loc, const std::string& path) {
  if (!Exists(loc, path)) return Status::NotFound("missing group '" + path + "'");
  H5O_info_t info;
  if (H5Oget_info_by_name2(loc, path.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0 || info.type != H5O_TYPE_GROUP) {
    H5Eclear2(H5E_DEFAULT);
    return Status::Corruption("'" + path + "' is not a group");
  }
  Hid g(H5Gopen2(loc, path.c_str(), H5P_DEFAULT));
  if (!g.valid()) return Error("cannot open group '" + path + "'");
  return g;
}

Hid CreationProps(hid_t cls) {
  Hid p(H5Pcreate(cls));
  // No modification times in object headers: the same run writes the same bytes.
  H5Pset_obj_track_times(p.get(), false);
  return p;
}

Result<Hid> CreateGroup(hid_t loc, const std::string& path) {
  Hid gcpl = CreationProps(H5P_GROUP_CREATE);
  Hid g(H5Gcreate2(loc, path.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT));
  if (!g.valid()) return Error("cannot create group '" + path + "'");
  return g;
}

Result<Hid> OpenDataset(hid_t loc, const std::string& path) {
  if (!Exists(loc, path)) return Status::NotFound("missing dataset '" + path + "'");
  H5O_info_t info;
  if (H5Oget_info_by_name2(loc, path.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0 ||
      info.type != H5O_TYPE_DATASET) {
    H5Eclear2(H5E_DEFAULT);
    return Status::Corruption("'" + path + "' is not a dataset");
  }
  Hid d(H5Dopen2(loc, path.c_str(), H5P_DEFAULT));
  if (!d.valid()) return Error("cannot open dataset '" + path + "'");
  return d;
}

namespace {

Status WriteScalarAttr(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type, const void* value) {
  // An existing scalar number is overwritten in place: the object header keeps its size and
  // layout, so the update is a single write of that header at the next flush (the per-flush
  // counters depend on it; docs/trace-format.md, "Crash safety").
  if (H5Aexists(obj, name.c_str()) > 0) {
    Hid a(H5Aopen(obj, name.c_str(), H5P_DEFAULT));
    Hid t(a.valid() ? H5Aget_type(a.get()) : H5I_INVALID_HID);
    if (t.valid() && H5Tequal(t.get(), file_type) > 0 && H5Tis_variable_str(file_type) <= 0) {
      if (H5Awrite(a.get(), mem_type, value) < 0) return Error("cannot write attribute '" + name + "'");
      return a.Close();
    }
    a.Reset();
    if (H5Adelete(obj, name.c_str()) < 0) return Error("cannot replace attribute '" + name + "'");
  }
  Hid space(H5Screate(H5S_SCALAR));
  Hid a(H5Acreate2(obj, name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!a.valid() || H5Awrite(a.get(), mem_type, value) < 0) return Error("cannot write attribute '" + name + "'");
  return a.Close();
}

Result<Hid> OpenAttr(hid_t obj, const std::string& name) {
  if (H5Aexists(obj, name.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return Status::NotFound("missing attribute '" + name + "'");
  }
  Hid a(H5Aopen(obj, name.c_str(), H5P_DEFAULT));
  if (!a.valid()) return Error("cannot open attribute '" + name + "'");
  return a;
}

// Number of elements of an attribute's dataspace, refusing absurd ones.
Result<hssize_t> AttrElements(hid_t a, const std::string& name, hssize_t max) {
  Hid space(H5Aget_space(a));
  const hssize_t n = space.valid() ? H5Sget_simple_extent_npoints(space.get()) : -1;
  if (n < 0) return Error("attribute '" + name + "': bad dataspace");
  if (n > max) return Status::Corruption("attribute '" + name + "': " + std::to_string(n) + " values, expected at most " +
                                         std::to_string(max));
  return n;
}

}  // namespace

Hid StringType(size_t bytes) {
  Hid t(H5Tcopy(H5T_C_S1));
  H5Tset_size(t.get(), std::max<size_t>(bytes, 1));
  H5Tset_strpad(t.get(), H5T_STR_NULLPAD);
  H5Tset_cset(t.get(), H5T_CSET_UTF8);
  return t;
}

Status WriteAttr(hid_t obj, const std::string& name, const std::string& value) {
  if (value.size() > kMaxStringAttr) {
    return Status::InvalidArgument("attribute '" + name + "': " + std::to_string(value.size()) +
                                   " bytes, more than an attribute holds (" + std::to_string(kMaxStringAttr) + ")");
  }
  Hid t = StringType(value.size());
  std::string padded = value;
  padded.resize(std::max<size_t>(value.size(), 1), '\0');
  return WriteScalarAttr(obj, name, t.get(), t.get(), padded.data());
}

Status WriteStringDataset(hid_t loc, const std::string& name, const std::string& value) {
  Hid t = StringType(value.size());
  std::string padded = value;
  padded.resize(std::max<size_t>(value.size(), 1), '\0');
  Hid space(H5Screate(H5S_SCALAR));
  Hid dcpl = CreationProps(H5P_DATASET_CREATE);
  Hid d(H5Dcreate2(loc, name.c_str(), t.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!d.valid() || H5Dwrite(d.get(), t.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, padded.data()) < 0) {
    return Error("cannot write '" + name + "'");
  }
  return d.Close();
}

Result<std::string> ReadStringDataset(hid_t loc, const std::string& path, size_t max_bytes) {
  LS_ASSIGN_OR_RETURN(Hid d, OpenDataset(loc, path));
  Hid ft(H5Dget_type(d.get()));
  Hid space(H5Dget_space(d.get()));
  if (!ft.valid() || H5Tget_class(ft.get()) != H5T_STRING || H5Tis_variable_str(ft.get()) != 0 || !space.valid() ||
      H5Sget_simple_extent_type(space.get()) != H5S_SCALAR) {
    H5Eclear2(H5E_DEFAULT);
    return Status::Corruption("'" + path + "': not a fixed-length string");
  }
  const size_t size = H5Tget_size(ft.get());
  if (size == 0 || size > max_bytes) return Status::Corruption("'" + path + "': " + std::to_string(size) + " bytes");
  // The bytes must be in the file before they are allocated here: a declared 1 GiB string
  // with no storage behind it is refused, not read as 1 GiB of fill value.
  if (H5Dget_storage_size(d.get()) < size) {
    H5Eclear2(H5E_DEFAULT);
    return Status::Corruption("'" + path + "': declares a " + std::to_string(size) + "-byte string but stores " +
                              std::to_string(H5Dget_storage_size(d.get())) + " bytes");
  }
  std::string s(size, '\0');
  Hid mt(H5Tcopy(ft.get()));
  if (H5Dread(d.get(), mt.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, s.data()) < 0) return Error("'" + path + "'");
  s.resize(std::min(s.size(), s.find('\0')));
  return s;
}

Status WriteAttr(hid_t obj, const std::string& name, int64_t value) {
  return WriteScalarAttr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

Status WriteAttr(hid_t obj, const std::string& name, double value) {
  return WriteScalarAttr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

Status WriteAttrU8(hid_t obj, const std::string& name, uint8_t value) {
  return WriteScalarAttr(obj, name, H5T_STD_U8LE, H5T_NATIVE_UINT8, &value);
}

Status WriteAttrI32s(hid_t obj, const std::string& name, const std::vector<int32_t>& values) {
  if (H5Aexists(obj, name.c_str()) > 0 && H5Adelete(obj, name.c_str()) < 0) {
    return Error("cannot replace attribute '" + name + "'");
  }
  const hsize_t n = values.size();
  Hid space(H5Screate_simple(1, &n, nullptr));
  Hid a(H5Acreate2(obj, name.c_str(), H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!a.valid() || H5Awrite(a.get(), H5T_NATIVE_INT32, values.data()) < 0) {
    return Error("cannot write attribute '" + name + "'");
  }
  return a.Close();
}

bool HasAttr(hid_t obj, const std::string& name) {
  const htri_t r = H5Aexists(obj, name.c_str());
  if (r < 0) H5Eclear2(H5E_DEFAULT);
  return r > 0;
}

Result<std::string> ReadStringAttr(hid_t obj, const std::string& name) {
  LS_ASSIGN_OR_RETURN(Hid a, OpenAttr(obj, name));
  Hid ft(H5Aget_type(a.get()));
  if (!ft.valid() || H5Tget_class(ft.get()) != H5T_STRING) {
    return Status::Corruption("attribute '" + name + "': not a string");
  }
  LS_ASSIGN_OR_RETURN(hssize_t n, AttrElements(a.get(), name, 1));
  if (n != 1) return Status::Corruption("attribute '" + name + "': not a scalar string");
  // Only fixed-length strings: variable-length ones live in HDF5's global heap, which this
  // format never uses and whose parser loops forever on some damaged files.
  if (H5Tis_variable_str(ft.get()) != 0) return Status::Corruption("attribute '" + name + "': not a fixed-length string");
  const size_t size = H5Tget_size(ft.get());
  if (size == 0 || size > (64u << 20)) return Status::Corruption("attribute '" + name + "': bad string size");
  std::string s(size, '\0');
  Hid mt(H5Tcopy(ft.get()));
  if (H5Aread(a.get(), mt.get(), s.data()) < 0) return Error("attribute '" + name + "'");
  s.resize(std::min(s.size(), s.find('\0')));
  return s;
}

Result<int64_t> ReadIntAttr(hid_t obj, const std::string& name) {
  LS_ASSIGN_OR_RETURN(Hid a, OpenAttr(obj, name));
  Hid ft(H5Aget_type(a.get()));
  if (!ft.valid() || H5Tget_class(ft.get()) != H5T_INTEGER) {
    return Status::Corruption("attribute '" + name + "': not an integer");
  }
  LS_ASSIGN_OR_RETURN(hssize_t n, AttrElements(a.get(), name, 1));
  if (n != 1) return Status::Corruption("attribute '" + name + "': not a scalar");
  int64_t v = 0;
  if (H5Aread(a.get(), H5T_NATIVE_INT64, &v) < 0) return Error("attribute '" + name + "'");
  return v;
}

Result<double> ReadDoubleAttr(hid_t obj, const std::string& name) {
  LS_ASSIGN_OR_RETURN(Hid a, OpenAttr(obj, name));
  Hid ft(H5Aget_type(a.get()));
  const H5T_class_t c = ft.valid() ? H5Tget_class(ft.get()) : H5T_NO_CLASS;
  if (c != H5T_FLOAT && c != H5T_INTEGER) return Status::Corruption("attribute '" + name + "': not a number");
  LS_ASSIGN_OR_RETURN(hssize_t n, AttrElements(a.get(), name, 1));
  if (n != 1) return Status::Corruption("attribute '" + name + "': not a scalar");
  double v = 0;
  if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) return Error("attribute '" + name + "'");
  return v;
}

Result<std::vector<int64_t>> ReadIntsAttr(hid_t obj, const std::string& name, size_t max_count) {
  LS_ASSIGN_OR_RETURN(Hid a, OpenAttr(obj, name));
  Hid ft(H5Aget_type(a.get()));
  if (!ft.valid() || H5Tget_class(ft.get()) != H5T_INTEGER) {
    return Status::Corruption("attribute '" + name + "': not integers");
  }
  LS_ASSIGN_OR_RETURN(hssize_t n, AttrElements(a.get(), name, static_cast<hssize_t>(max_count)));
  std::vector<int64_t> v(n);
  if (n > 0 && H5Aread(a.get(), H5T_NATIVE_INT64, v.data()) < 0) return Error("attribute '" + name + "'");
  return v;
}

Result<std::vector<std::string>> AttrNames(hid_t obj) {
  std::vector<std::string> names;
  hsize_t idx = 0;
  const herr_t rc = H5Aiterate2(
      obj, H5_INDEX_NAME, H5_ITER_INC, &idx,
      [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->push_back(name);
        return 0;
      },
      &names);
  if (rc < 0) return Error("cannot list attributes");
  return names;
}

Result<std::vector<std::string>> LinkNames(hid_t group) {
  std::vector<std::string> names;
  hsize_t idx = 0;
  const herr_t rc = H5Literate(
      group, H5_INDEX_NAME, H5_ITER_INC, &idx,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        auto* v = static_cast<std::vector<std::string>*>(data);
        if (v->size() >= (1u << 20)) return 1;  // a group of a million links is not ours
        v->push_back(name);
        return 0;
      },
      &names);
  if (rc < 0) return Error("cannot list group");
  return names;
}

Result<std::vector<hsize_t>> Dims(hid_t dataset, int max_rank) {
  Hid space(H5Dget_space(dataset));
  const int rank = space.valid() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (rank < 0) return Error("bad dataspace");
  if (rank > max_rank) return Status::Corruption("rank " + std::to_string(rank) + ", expected at most " +
                                                 std::to_string(max_rank));
  std::vector<hsize_t> dims(rank);
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0) return Error("bad dataspace");
  return dims;
}

}  // namespace lockstep::traces::h5

"""lockstep/_torchzip.py — reads what torch.save wrote, without torch, for files nobody vouches
for (another engine's tensor dumps): the zip serialization that torch.save has written by
default since torch 1.6.

    obj = load("dump.pt")          # dicts, lists, tuples, str, int, float, bool, None, bytes
    obj["value"].dtype             # "bfloat16"; .shape; .array (as stored: uint16 for bf16)
    obj["value"].to_f32()          # float32 (bf16 widened by a 16-bit shift, fp16/fp8 decoded)

The format (torch/serialization.py, `_save` and `_load`): a zip archive, every member stored
(not compressed), all under one top folder `<archive>/`:

    <archive>/data.pkl     a pickle (protocol 2) of the object; each tensor is
                           torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
                           requires_grad, backward_hooks[, metadata]) with backward_hooks an
                           empty collections.OrderedDict, and each storage a persistent id
                           ("storage", torch.<Type>Storage, key, location, numel); dtypes that
                           have no <Type>Storage (float8) come as _rebuild_tensor_v3(…,
                           backward_hooks, torch.<dtype>[, metadata]) on a
                           torch.storage.UntypedStorage, whose numel counts bytes
    <archive>/data/<key>   the storage's bytes: numel elements of its dtype, nothing else
    <archive>/byteorder    "little" or "big" (absent in files before torch 2.1: little)
    <archive>/version, .format_version, .storage_alignment, .data/serialization_id  (not read)

<archive> is the file's name without its extension (torch 2.11 writes "f8/data.pkl" for f8.pt).

The pickle is interpreted by a small machine of its own (not the pickle module), which knows
only the opcodes such files use. Nothing in the file is ever called: the only globals it
resolves are the tensor rebuild functions, OrderedDict and the storage types below, each a
marker this module interprets itself (and the torch.<dtype> objects _rebuild_tensor_v3 names);
any other global (os.system, builtins.eval, a class) is
refused before anything else happens, and so are the opcodes that would build objects (BUILD,
NEWOBJ, INST, OBJ). Every size, offset and stride is checked against the storage's real
length before a view is made, and against the caps below before anything is allocated. Every
problem is one TraceError naming the file and the field. Not thread-safe per call; no state
is kept between calls.

Refused: torch's legacy formats (the tar archive before 1.6 and the
_use_new_zipfile_serialization=False stream, whose storages come through
torch.storage._load_from_bytes), TorchScript archives, compressed or encrypted members, dtypes
other than those in STORAGES (complex, quantised, fnuz float8, unsigned 16–64 bit).
"""
import io
import pickletools
import re
import struct
import zipfile

import numpy as np

from ._format import TraceError
from .dtypes import E4M3, bf16_to_f32

# Caps: what one file may make this reader allocate or do.
MAX_FILE_BYTES = 8 << 30         # the whole .pt file
MAX_PICKLE_BYTES = 64 << 20      # data.pkl (a tensor's pickle is ~300 bytes)
MAX_ELEMENTS = 1 << 31           # elements of one tensor
MAX_TENSOR_BYTES = 4 << 30       # one tensor as read (before widening to float32)
MAX_BROADCAST = 64               # a view may hold this many times its storage's elements (stride-0
                                 # broadcasts are legal; a 1-element storage read as 2^31 is not)
MAX_DIMS = 16
MAX_MEMBERS = 1 << 16            # zip members
MAX_ITEMS = 1 << 22              # stack + memo entries of the pickle machine
MAX_LONG_BYTES = 64              # a pickled integer (sizes and offsets fit in 9 bytes)

# torch's storage type → (element dtype as stored, little-endian; torch's dtype name).
STORAGES = {
    "FloatStorage": ("<f4", "float32"),
    "DoubleStorage": ("<f8", "float64"),
    "HalfStorage": ("<f2", "float16"),
    "BFloat16Storage": ("<u2", "bfloat16"),
    "Float8_e4m3fnStorage": ("u1", "float8_e4m3fn"),
    "Float8_e5m2Storage": ("u1", "float8_e5m2"),
    "LongStorage": ("<i8", "int64"),
    "IntStorage": ("<i4", "int32"),
    "ShortStorage": ("<i2", "int16"),
    "CharStorage": ("i1", "int8"),
    "ByteStorage": ("u1", "uint8"),
    "BoolStorage": ("u1", "bool"),
}
_READ_NAMES = ", ".join(v[1] for v in STORAGES.values())
DTYPES = {v[1]: v[0] for v in STORAGES.values()}  # torch.<dtype> globals of _rebuild_tensor_v3


def _e5m2_table():
    # OCP E5M2: bias 15, infinities and NaNs as in IEEE half (it is fp16's top byte).
    return (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)


E5M2 = _e5m2_table()


class SavedTensor:
    """A tensor read from a torch.save file: `dtype` (torch's name: "bfloat16", "int64", …),
    `shape` (tuple), `array` (numpy, C-contiguous, as stored: bf16 as uint16, fp8 as uint8,
    bool as bool), `requires_grad`, `location` (the device it was saved from)."""

    def __init__(self, dtype, array, requires_grad, location):
        self.dtype = dtype
        self.array = array
        self.shape = tuple(array.shape)
        self.requires_grad = requires_grad
        self.location = location

    @property
    def is_floating_point(self):
        return self.dtype.startswith(("float", "bfloat"))

    def to_f32(self):
        """The values as float32: bf16 widened (u16 << 16), fp16 and fp8 decoded, float64
        rounded to nearest, integers and bool converted."""
        a = self.array
        if self.dtype == "bfloat16":
            return bf16_to_f32(a)
        if self.dtype == "float8_e4m3fn":
            return E4M3[a]
        if self.dtype == "float8_e5m2":
            return E5M2[a]
        return a.astype(np.float32)

    def __repr__(self):
        return f"SavedTensor({self.dtype}, {list(self.shape)})"


# -- markers for the globals a tensor needs -----------------------------------------------------
class _Global:
    def __init__(self, kind, name, storage=None):
        self.kind, self.name, self.storage = kind, name, storage


_REBUILD = _Global("rebuild", "torch._utils._rebuild_tensor_v2")
_REBUILD3 = _Global("rebuild3", "torch._utils._rebuild_tensor_v3")
_UNTYPED = _Global("storage", "torch.storage.UntypedStorage", ("u1", "untyped"))
_PARAM = _Global("param", "torch._utils._rebuild_parameter")
_ODICT = _Global("odict", "collections.OrderedDict")


class _Storage:
    """A storage's bytes: `numel` elements of np_dtype (for an untyped one: bytes)."""

    def __init__(self, key, np_dtype, torch_dtype, numel, data, location, big):
        self.key, self.np_dtype, self.torch_dtype = key, np_dtype, torch_dtype
        self.numel, self.data, self.location, self.big = numel, data, location, big


def _bad(where, field, why):
    return TraceError(f"{where}: {field}: {why}")


def load(path):
    """The object in torch.save file `path` (tensors as SavedTensor). Raises TraceError."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            if size > MAX_FILE_BYTES:
                raise TraceError(f"{path}: {size} bytes, more than an import reads ({MAX_FILE_BYTES >> 30} GiB)")
            fh.seek(0)
            raw = fh.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})")
    return loads(raw, path)


def loads(raw, where="<bytes>"):
    """The object in the bytes of a torch.save file; `where` names it in errors."""
    _check_container(raw, where)
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = zf.infolist()
    except TraceError:
        raise
    except Exception as e:  # BadZipFile, struct.error, OverflowError … on a damaged archive
        raise TraceError(f"{where}: not a readable zip archive, so not a torch.save file (truncated or damaged?): "
                         f"{_why(e)}")
    members = _members(infos, where)
    prefix = members["prefix"]

    def read(name, field, cap):
        info = members["by_name"].get(name)
        if info is None:
            return None
        if info.file_size > cap:
            raise _bad(where, field, f"{info.file_size} bytes, more than a torch.save file holds there ({cap})")
        try:
            data = zf.read(info)
        except Exception as e:
            raise _bad(where, field, f"unreadable zip member ({_why(e)})")
        if len(data) != info.file_size:
            raise _bad(where, field, f"{len(data)} bytes read, the zip directory says {info.file_size}")
        return data

    order = read(prefix + "byteorder", f"zip member '{prefix}byteorder'", 16)
    if order is not None and order not in (b"little", b"big"):
        raise _bad(where, f"zip member '{prefix}byteorder'", f"{order[:16]!r} is neither 'little' nor 'big'")
    big = order == b"big"
    pkl = read(prefix + "data.pkl", f"zip member '{prefix}data.pkl'", MAX_PICKLE_BYTES)
    if pkl is None:
        raise _bad(where, f"zip member '{prefix}data.pkl'", "missing, so not a torch.save archive")
    storages = {}

    def storage(pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise _bad(where, "data.pkl: persistent id",
                       f"{_short(pid)} is not ('storage', type, key, location, numel)")
        _, st, key, location, numel = pid
        if not isinstance(st, _Global) or st.kind != "storage":
            raise _bad(where, "data.pkl: persistent id", f"storage type {_short(st)} is not a torch.*Storage")
        if not isinstance(key, str) or not re.fullmatch(r"[0-9]{1,12}", key):
            raise _bad(where, "data.pkl: storage key", f"{_short(key)} is not a decimal key (data/<key>)")
        if not isinstance(location, str) or len(location) > 64:
            raise _bad(where, f"data.pkl: storage {key}: location", f"{_short(location)} is not a device name")
        if not _is_int(numel) or numel < 0:
            raise _bad(where, f"data.pkl: storage {key}: numel", f"{_short(numel)} is not a count")
        np_dtype, torch_dtype = st.storage
        if key in storages:
            s = storages[key]
            if s.torch_dtype != torch_dtype or s.numel != numel:
                raise _bad(where, f"data.pkl: storage {key}", f"referenced as {torch_dtype}[{numel}] and as "
                           f"{s.torch_dtype}[{s.numel}]")
            return s
        dt = _ordered(np_dtype, big)
        want = numel * dt.itemsize
        name = f"{prefix}data/{key}"
        if name not in members["by_name"]:
            raise _bad(where, f"zip member '{name}'", f"missing (storage {key} of data.pkl)")
        info = members["by_name"][name]
        if info.file_size != want:
            raise _bad(where, f"zip member '{name}'", f"{info.file_size} bytes, but data.pkl says {numel} "
                       f"{torch_dtype} elements ({want} bytes)")
        data = read(name, f"zip member '{name}'", MAX_FILE_BYTES)
        s = _Storage(key, dt, torch_dtype, numel, data, location, big)
        storages[key] = s
        return s

    obj = _Machine(pkl, where, storage).run()
    return obj


def _check_container(raw, where):
    if raw[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return
    # The legacy stream: a pickled magic number 0x1950a86a20f9469cfc6c (protocol 2: 80 02 8a 0a …).
    if raw[:4] == b"\x80\x02\x8a\x0a" and raw[4:14] == (0x1950a86a20f9469cfc6c).to_bytes(10, "little"):
        raise TraceError(f"{where}: torch's legacy serialization (_use_new_zipfile_serialization=False, "
                         "storages through torch.storage._load_from_bytes): not read; save it again with "
                         "torch.save's default")
    if len(raw) > 262 and raw[257:262] == b"ustar":
        raise TraceError(f"{where}: a tar archive (torch.save before torch 1.6): not read; save it again with a "
                         "current torch.save")
    if not raw:
        raise TraceError(f"{where}: empty file, not a torch.save file")
    raise TraceError(f"{where}: not a zip archive (starts {raw[:4].hex()}), so not a torch.save file")


def _members(infos, where):
    if len(infos) > MAX_MEMBERS:
        raise TraceError(f"{where}: {len(infos)} zip members, more than a torch.save file has")
    if not infos:
        raise TraceError(f"{where}: an empty zip archive, not a torch.save file")
    by_name, prefix = {}, None
    for info in infos:
        n = info.filename
        field = f"zip member {n[:80]!r}"
        if (not n or n.startswith("/") or "\\" in n or "\0" in n or any(p in ("", ".", "..") for p in n.split("/"))):
            raise _bad(where, field, "not a plain relative path (absolute, empty part, '.' or '..')")
        if n in by_name:
            raise _bad(where, field, "appears twice in the zip directory")
        if info.flag_bits & 0x1:
            raise _bad(where, field, "encrypted")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _bad(where, field, f"compressed (method {info.compress_type}); torch.save stores members "
                       "uncompressed")
        if info.file_size > MAX_FILE_BYTES:
            raise _bad(where, field, f"{info.file_size} bytes, more than an import reads")
        top = n.split("/")[0]
        if prefix is None:
            prefix = top
        elif top != prefix:
            raise _bad(where, field, f"outside the archive's folder '{prefix}/' (torch.save writes one)")
        if "/" not in n:
            raise _bad(where, field, "not inside the archive's folder")
        by_name[n] = info
    p = prefix + "/"
    if p + "constants.pkl" in by_name or any(n.startswith(p + "code/") for n in by_name):
        raise TraceError(f"{where}: a TorchScript archive (torch.jit.save), not a torch.save file")
    return {"prefix": p, "by_name": by_name}


def _ordered(np_dtype, big):
    dt = np.dtype(np_dtype)
    return dt.newbyteorder(">" if big else "<") if dt.itemsize > 1 else dt


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v):
    s = repr(v) if not isinstance(v, _Global) else v.name
    return s if len(s) <= 60 else s[:57] + "..."


def _why(e):
    s = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


# -- the pickle machine --------------------------------------------------------------------------
_MARK = object()


class _Machine:
    """Interprets a pickle of plain data and tensors; see the module's docstring."""

    def __init__(self, data, where, storage):
        self.data, self.where, self.storage = data, where, storage
        self.pos = 0
        self.stack, self.marks, self.memo = [], [], {}

    def err(self, why):
        return TraceError(f"{self.where}: data.pkl: {why}")

    def take(self, n):
        if n < 0 or self.pos + n > len(self.data):
            left = len(self.data) - self.pos
            raise self.err(f"truncated (an opcode at byte {self.pos} needs {n} bytes, {left} left)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def line(self):
        end = self.data.find(b"\n", self.pos, self.pos + 512)
        if end < 0:
            raise self.err(f"an unterminated text argument at byte {self.pos}")
        b = self.data[self.pos:end]
        self.pos = end + 1
        return b

    def push(self, v):
        if len(self.stack) + len(self.memo) >= MAX_ITEMS:
            raise self.err(f"more than {MAX_ITEMS} objects on the stack and in the memo")
        self.stack.append(v)

    def pop(self):
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise self.err(f"stack underflow at byte {self.pos}")
        return self.stack.pop()

    def top(self):
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise self.err(f"stack underflow at byte {self.pos}")
        return self.stack[-1]

    def pop_mark(self):
        if not self.marks:
            raise self.err(f"no MARK for the opcode at byte {self.pos}")
        i = self.marks.pop()
        items = self.stack[i:]
        del self.stack[i:]
        return items

    def text(self, b):
        try:
            return b.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return b.decode("latin-1")

    def put(self, i):
        if len(self.stack) + len(self.memo) >= MAX_ITEMS:
            raise self.err(f"more than {MAX_ITEMS} objects on the stack and in the memo")
        self.memo[i] = self.top()

    def get(self, i):
        if i not in self.memo:
            raise self.err(f"memo entry {i} read before it was written")
        self.push(self.memo[i])

    def setitems(self, d, items):
        if not isinstance(d, dict):
            raise self.err(f"SETITEM(S) on a {type(d).__name__}, not a dict")
        if len(items) % 2:
            raise self.err("SETITEMS with an odd number of items")
        for k, v in zip(items[0::2], items[1::2]):
            try:
                d[k] = v
            except TypeError:
                raise self.err(f"a dict key of type {type(k).__name__} (unhashable)")

    def find_global(self, mod, name):
        full = f"{mod}.{name}"
        if full == _REBUILD.name:
            return _REBUILD
        if full == _REBUILD3.name:
            return _REBUILD3
        if full in (_UNTYPED.name, "torch.UntypedStorage"):
            return _UNTYPED
        if mod == "torch" and name in DTYPES:
            return _Global("dtype", full, (DTYPES[name], name))
        if full == _PARAM.name:
            return _PARAM
        if full == _ODICT.name:
            return _ODICT
        if mod == "torch" and name in STORAGES:
            return _Global("storage", full, STORAGES[name])
        if full == "torch.storage._load_from_bytes":
            raise self.err("global torch.storage._load_from_bytes: torch's legacy serialization "
                           "(_use_new_zipfile_serialization=False) is not read; save it again with torch.save's "
                           "default")
        if mod in ("torch", "torch.storage") and name.endswith("Storage"):
            raise self.err(f"storage type {full}: a dtype lockstep does not read ({_READ_NAMES} are)")
        if mod == "torch" and re.fullmatch(r"(float|int|uint|bfloat|complex|bool|qu?int|bits)[0-9a-z_]*", name):
            raise self.err(f"dtype {full}: not one lockstep reads ({_READ_NAMES} are)")
        raise self.err(f"global {full[:100]} is not allowed (a tensor needs only torch._utils._rebuild_tensor_v2, "
                       "collections.OrderedDict and torch.*Storage types); refused, nothing was called")

    def reduce(self, fn, args):
        if not isinstance(fn, _Global) or fn.kind in ("storage", "dtype"):
            raise self.err(f"REDUCE calls {_short(fn)}, which is not a function this reader knows")
        if not isinstance(args, tuple):
            raise self.err(f"REDUCE of {fn.name} with arguments {_short(args)} (not a tuple)")
        if fn is _ODICT:
            if args == ():
                return {}
            pairs = len(args) == 1 and isinstance(args[0], list)
            if pairs and all(isinstance(p, tuple) and len(p) == 2 for p in args[0]):
                d = {}
                self.setitems(d, [x for p in args[0] for x in p])
                return d
            raise self.err(f"collections.OrderedDict{_short(args)}: only empty or a list of pairs")
        if fn is _PARAM:
            if len(args) not in (2, 3) or not isinstance(args[0], SavedTensor):
                raise self.err(f"torch._utils._rebuild_parameter{_short(args)}: not (tensor, requires_grad, hooks)")
            return args[0]
        return self.rebuild(args, v3=fn is _REBUILD3)

    def rebuild(self, args, v3):
        f = "torch._utils._rebuild_tensor_v3" if v3 else "torch._utils._rebuild_tensor_v2"
        n = 7 if v3 else 6
        if len(args) not in (n, n + 1):
            raise self.err(f"{f} with {len(args)} arguments ({n} or {n + 1}: storage, offset, size, stride, "
                           f"requires_grad, backward_hooks{', dtype' if v3 else ''}[, metadata])")
        st, offset, size, stride, rg, hooks = args[:6]
        if not isinstance(st, _Storage):
            raise self.err(f"{f}: storage {_short(st)} is not a persistent storage")
        where = f"tensor on storage {st.key}"
        if v3:
            dt = args[6]
            if not isinstance(dt, _Global) or dt.kind != "dtype":
                raise self.err(f"{where}: dtype {_short(dt)} is not a torch dtype")
            np_dtype, torch_dtype = dt.storage
            if st.torch_dtype not in ("untyped", torch_dtype):
                raise self.err(f"{where}: a {st.torch_dtype} storage read as {torch_dtype}")
            elem = _ordered(np_dtype, st.big)
            nbytes = st.numel * st.np_dtype.itemsize
            if nbytes % elem.itemsize:
                raise self.err(f"{where}: {nbytes} bytes are not whole {torch_dtype} elements")
            count = nbytes // elem.itemsize
        elif st.torch_dtype == "untyped":
            raise self.err(f"{where}: an untyped storage without a dtype ({f} needs a typed one)")
        else:
            elem, torch_dtype, count = st.np_dtype, st.torch_dtype, st.numel
        if not _is_int(offset) or offset < 0:
            raise self.err(f"{where}: storage_offset {_short(offset)} is not a count ≥ 0")
        if not isinstance(size, (tuple, list)) or not all(_is_int(s) for s in size):
            raise self.err(f"{where}: size {_short(size)} is not a tuple of integers")
        if not isinstance(stride, (tuple, list)) or not all(_is_int(s) for s in stride):
            raise self.err(f"{where}: stride {_short(stride)} is not a tuple of integers")
        if len(size) > MAX_DIMS:
            raise self.err(f"{where}: {len(size)} dimensions, more than {MAX_DIMS}")
        if len(stride) != len(size):
            raise self.err(f"{where}: size has {len(size)} dimensions, stride {len(stride)}")
        if any(s < 0 for s in size):
            raise self.err(f"{where}: size {_short(tuple(size))} has a negative extent")
        if any(s < 0 for s in stride):
            raise self.err(f"{where}: stride {_short(tuple(stride))} has a negative step (torch never writes one)")
        if not isinstance(rg, bool):
            raise self.err(f"{where}: requires_grad {_short(rg)} is not a bool")
        if not isinstance(hooks, dict):
            raise self.err(f"{where}: backward_hooks {_short(hooks)} is not an OrderedDict")
        if len(args) == n + 1 and not isinstance(args[n], (dict, type(None))):
            raise self.err(f"{where}: metadata {_short(args[n])} is not a dict")
        numel = 1
        for s in size:
            numel *= s
        if numel > MAX_ELEMENTS:
            raise self.err(f"{where}: shape {_short(tuple(size))} has {numel} elements, more than an import reads "
                           f"(2^{MAX_ELEMENTS.bit_length() - 1})")
        if numel * elem.itemsize > MAX_TENSOR_BYTES:
            raise self.err(f"{where}: shape {_short(tuple(size))} of {torch_dtype} is {numel * elem.itemsize} bytes, "
                           f"more than an import reads ({MAX_TENSOR_BYTES >> 30} GiB)")
        if numel > MAX_BROADCAST * count + (1 << 16):
            raise self.err(f"{where}: shape {_short(tuple(size))} has {numel} elements over a storage of {count} "
                           f"(stride 0 broadcast beyond {MAX_BROADCAST}×): refused")
        if numel:
            last = offset + sum((s - 1) * t for s, t in zip(size, stride))
            if last >= count:
                raise self.err(f"{where}: offset {offset}, size {_short(tuple(size))}, stride {_short(tuple(stride))} "
                               f"reach element {last}, but the storage holds {count}")
        dt = elem
        native = dt.newbyteorder("=") if dt.itemsize > 1 else dt
        if numel == 0:
            arr = np.zeros(tuple(size), dtype=native)
        else:
            base = np.frombuffer(st.data, dtype=dt, count=count)[offset:]
            view = np.lib.stride_tricks.as_strided(base, shape=tuple(size),
                                                   strides=tuple(t * dt.itemsize for t in stride), writeable=False)
            arr = np.array(view, dtype=native, order="C", copy=True)  # 0-d stays 0-d
        if torch_dtype == "bool":
            if arr.size and int(arr.max()) > 1:
                raise self.err(f"{where}: a bool tensor holds byte values other than 0 and 1")
            arr = arr.astype(bool)
        return SavedTensor(torch_dtype, arr, rg, st.location)

    def run(self):
        take, u, push, pop = self.take, self.u, self.push, self.pop
        while True:
            if self.pos >= len(self.data):
                raise self.err("truncated (no STOP opcode)")
            op = self.data[self.pos]
            at = self.pos
            self.pos += 1
            if op == 0x80:  # PROTO
                p = take(1)[0]
                if not 2 <= p <= 5:
                    raise self.err(f"pickle protocol {p} (torch.save writes 2)")
            elif op == 0x95:  # FRAME (protocol 4): a length hint
                take(8)
            elif op == 0x2E:  # STOP
                if self.marks or len(self.stack) != 1:
                    raise self.err(f"STOP with {len(self.stack)} objects on the stack")
                return self.stack[0]
            elif op == 0x28:  # MARK
                self.marks.append(len(self.stack))
            elif op == 0x30:  # POP
                pop()
            elif op == 0x31:  # POP_MARK
                self.pop_mark()
            elif op == 0x32:  # DUP
                push(self.top())
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x4A:  # BININT
                push(u("<i"))
            elif op == 0x4B:  # BININT1
                push(take(1)[0])
            elif op == 0x4D:  # BININT2
                push(u("<H"))
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                n = take(1)[0] if op == 0x8A else u("<i")
                if not 0 <= n <= MAX_LONG_BYTES:
                    raise self.err(f"an integer of {n} bytes at byte {at}")
                push(int.from_bytes(take(n), "little", signed=True))
            elif op == 0x49:  # INT (text; protocol 0's bools)
                s = self.line()
                push(True if s == b"01" else False if s == b"00" else self._int_text(s))
            elif op == 0x47:  # BINFLOAT
                push(u(">d"))
            elif op in (0x58, 0x8C, 0x8D):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                n = u("<I") if op == 0x58 else take(1)[0] if op == 0x8C else u("<Q")
                push(self.text(take(n)))
            elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (Python 2 str)
                n = u("<i") if op == 0x54 else take(1)[0]
                push(self.text(take(n)))
            elif op in (0x42, 0x43, 0x8E, 0x96):  # BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                n = u("<I") if op == 0x42 else take(1)[0] if op == 0x43 else u("<Q")
                push(bytes(take(n)))
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
            elif op == 0x74:  # TUPLE
                push(tuple(self.pop_mark()))
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                n = op - 0x84
                items = [pop() for _ in range(n)][::-1]
                push(tuple(items))
            elif op == 0x5D:  # EMPTY_LIST
                push([])
            elif op == 0x6C:  # LIST
                push(self.pop_mark())
            elif op == 0x61:  # APPEND
                v = pop()
                lst = self.top()
                if not isinstance(lst, list):
                    raise self.err(f"APPEND to a {type(lst).__name__}, not a list")
                lst.append(v)
            elif op == 0x65:  # APPENDS
                items = self.pop_mark()
                lst = self.top()
                if not isinstance(lst, list):
                    raise self.err(f"APPENDS to a {type(lst).__name__}, not a list")
                lst.extend(items)
            elif op == 0x7D:  # EMPTY_DICT
                push({})
            elif op == 0x64:  # DICT
                d = {}
                self.setitems(d, self.pop_mark())
                push(d)
            elif op == 0x73:  # SETITEM
                v = pop()
                k = pop()
                self.setitems(self.top(), [k, v])
            elif op == 0x75:  # SETITEMS
                items = self.pop_mark()
                self.setitems(self.top(), items)
            elif op == 0x71:  # BINPUT
                self.put(take(1)[0])
            elif op == 0x72:  # LONG_BINPUT
                self.put(u("<I"))
            elif op == 0x94:  # MEMOIZE
                self.put(len(self.memo))
            elif op == 0x68:  # BINGET
                self.get(take(1)[0])
            elif op == 0x6A:  # LONG_BINGET
                self.get(u("<I"))
            elif op == 0x63:  # GLOBAL
                mod = self.text(self.line())
                name = self.text(self.line())
                push(self.find_global(mod, name))
            elif op == 0x93:  # STACK_GLOBAL
                name = pop()
                mod = pop()
                if not isinstance(mod, str) or not isinstance(name, str):
                    raise self.err("STACK_GLOBAL of non-strings")
                push(self.find_global(mod, name))
            elif op == 0x52:  # REDUCE
                args = pop()
                fn = pop()
                push(self.reduce(fn, args))
            elif op == 0x51:  # BINPERSID
                push(self.storage(pop()))
            else:
                info = pickletools.code2op.get(chr(op))
                name = info.name if info else "unknown"
                raise self.err(f"opcode 0x{op:02x} ({name}) at byte {at} is not allowed in a tensor file "
                               "(it would build or call an object)")

    def _int_text(self, s):
        if len(s) > 40 or not re.fullmatch(rb"-?[0-9]+L?", s):
            raise self.err(f"INT argument {s[:40]!r} is not a number")
        return int(s.rstrip(b"L"))

"""Bounded GGUF reader: header, metadata, tensor table, split shards.

Every count, length and offset read from the file is checked against the bytes
that are left BEFORE it is used, so a truncated, corrupt or hostile file is
refused with a GGUFError that names the file, the field, the value and the
bound -- never a MemoryError, a crash or a read past the end. The rules follow
llama.cpp's ggml/src/gguf.cpp (v2 and v3, little-endian, no nested arrays,
tensors packed in file order at `general.alignment`).
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 63          # ggml's GGML_MAX_NAME (64) holds the name and its NUL
INT64_MAX = 2**63 - 1
# smallest bytes one record can take; used to bound counts before looping
MIN_KV_BYTES = 8 + 1 + 4 + 1                 # key length, 1-byte key, type, 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name len, name, n_dims, one dim, type, offset
SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# value type -> (struct/numpy code, byte size) for the fixed-size scalars
_SCALAR = {
    GGUFValueType.UINT8: ("<u1", 1), GGUFValueType.INT8: ("<i1", 1),
    GGUFValueType.UINT16: ("<u2", 2), GGUFValueType.INT16: ("<i2", 2),
    GGUFValueType.UINT32: ("<u4", 4), GGUFValueType.INT32: ("<i4", 4),
    GGUFValueType.FLOAT32: ("<f4", 4), GGUFValueType.BOOL: ("<u1", 1),
    GGUFValueType.UINT64: ("<u8", 8), GGUFValueType.INT64: ("<i8", 8),
    GGUFValueType.FLOAT64: ("<f8", 8),
}


class GGUFError(Exception):
    """A GGUF file was refused; the message names the file, field, value and bound."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int            # gguf.GGMLQuantizationType value
    type_name: str            # its name, e.g. "Q4_K"
    shape: tuple[int, ...]    # ne order: shape[0] is the contiguous (row) length
    n_bytes: int
    offset: int               # absolute offset in `path`
    path: str                 # the shard that holds it


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads little-endian fields from a buffer, refusing any read past `end`."""

    def __init__(self, buf, path: str, end: int):
        self.buf, self.path, self.end, self.pos = buf, path, end, 0

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def left(self) -> int:
        return self.end - self.pos

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes > self.left():
            raise self.fail(f"truncated: {what} needs {n_bytes} bytes at offset {self.pos}, "
                            f"only {self.left()} left in the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # surrogateescape keeps bytes that are not UTF-8 (llama.cpp does not check them)
        return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, n: int, key: str) -> "StringArray":
        """n strings (an array's elements), bounded as string() would be, with the same refusals. The
        elements are decoded when first read (StringArray): most readers of a header want only the count.
        Vocabularies hold 150k+ of them, so the walk over their length fields is one bare loop; a walk that
        runs past the end is walked again with every check, which names the element."""
        buf, start, end = self.buf, self.pos, self.end
        length = _U64.unpack_from
        offsets = [0] * n                            # each element's length field
        pos = start
        try:
            for i in range(n):
                offsets[i] = pos
                pos += 8 + length(buf, pos)[0]
        except (struct.error, OverflowError):       # a length field past the buffer
            pos = end + 1
        if pos > end:
            self._strings_checked(n, key)            # raises the refusal that names the element
            raise self.fail(f"key {key!r}: its {n} strings run past the file end")
        self.pos = pos
        return StringArray(bytes(buf[start:pos]), np.array(offsets, np.int64) - start)

    def _strings_checked(self, n: int, key: str) -> None:
        buf, pos, end = self.buf, self.pos, self.end
        length = _U64.unpack_from
        for i in range(n):
            if end - pos < 8:
                self.pos = pos
                self.need(8, f"element {i} of {key!r} length")
            (ln,) = length(buf, pos)
            pos += 8
            if ln > end - pos:
                self.pos = pos
                self.need(ln, f"element {i} of {key!r} ({ln} bytes)")
            pos += ln
        self.pos = pos

    def array(self, n: int, code: str, size: int) -> list:
        arr = np.frombuffer(self.buf, dtype=code, count=n, offset=self.pos)
        self.pos += n * size
        return arr.tolist()


class StringArray(Sequence):
    """A GGUF string array, kept as its packed bytes (each element: u64 length, then its bytes, already
    bounded by the reader) and decoded to a list of str on the first element read, then kept. The header's
    readers that need only the count (the plan, the engine: a vocabulary's size) never pay for decoding
    150,000 tokens and as many merges. Decoding keeps bytes that are not UTF-8 as surrogate escapes
    (llama.cpp does not check them); all_utf8() says, without decoding, whether there are any."""

    __slots__ = ("_raw", "_offsets", "_n", "_items")
    __hash__ = None

    def __init__(self, raw: bytes, offsets: np.ndarray):
        # offsets: [n] int64, where each element's length field starts in raw
        self._raw, self._offsets, self._n, self._items = raw, offsets, len(offsets), None

    def _list(self) -> list[str]:
        if self._items is None:
            text = self._text()
            self._items = text.split("\udcff") if self._valid(text) else self._decode_each()
            self._raw, self._offsets = b"", self._offsets[:0]
        return self._items

    def _decode_each(self) -> list[str]:
        raw, pos = self._raw, 0
        length = _U64.unpack_from
        out = [""] * self._n
        for i in range(self._n):
            (ln,) = length(raw, pos)
            pos += 8
            out[i] = str(raw[pos:pos + ln], "utf-8", "surrogateescape")
            pos += ln
        return out

    def _text(self) -> str:
        """The elements in one decode, each length field turned into one 0xFF byte, a byte UTF-8 never
        holds: it decodes to the escape \\udcff, so the decoder starts each element afresh."""
        raw = np.frombuffer(self._raw, np.uint8)                      # [bytes]
        starts = self._offsets                                        # [n]
        keep = np.ones(raw.size, bool)                                # [bytes]
        keep[(starts[:, None] + np.arange(1, 8)).ravel()] = False    # a length field's first byte stays
        joined = raw.copy()
        joined[starts] = 0xFF
        return joined[keep].tobytes()[1:].decode("utf-8", "surrogateescape")

    def _valid(self, text: str) -> bool:
        """Every element was UTF-8: no 0xFF but the n - 1 separators, and no other escape."""
        return self._n > 0 and text.count("\udcff") == self._n - 1 and _encodes(text.replace("\udcff", ""))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(other) == self._n and list(other) == self._list()
        return NotImplemented

    def __repr__(self) -> str:
        return f"StringArray({self._list()!r})"

    def find(self, text: str) -> int | None:
        """The index of the first element equal to text, or None; packed, without decoding the others."""
        if self._items is not None:
            return self._items.index(text) if text in self._items else None
        want = text.encode("utf-8", "surrogateescape")
        pattern, raw, pos = _U64.pack(len(want)) + want, self._raw, -1
        while (pos := raw.find(pattern, pos + 1)) >= 0:
            i = int(np.searchsorted(self._offsets, pos))
            if i < self._n and int(self._offsets[i]) == pos:      # an element's start, not bytes inside one
                return i
        return None

    def all_utf8(self) -> bool:
        """Every element is valid UTF-8 (as str(raw, "utf-8") would accept it), without a str per element."""
        if self._items is None:
            return self._n == 0 or self._valid(self._text())
        return _encodes("".join(self._items))


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:        # a surrogate escape: bytes that were not UTF-8
        return False


def _read_value(cur: _Cursor, key: str, vtype: int):
    """One metadata value of type `vtype`; returns (value, (vtype, subtype))."""
    if vtype in _SCALAR:
        code, size = _SCALAR[vtype]
        cur.need(size, f"value of {key!r}")
        v = cur.array(1, code, size)[0]
        return (bool(v) if vtype == GGUFValueType.BOOL else v), (vtype, None)
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}"), (vtype, None)
    if vtype == GGUFValueType.ARRAY:
        sub = cur.u32(f"element type of {key!r}")
        n = cur.u64(f"element count of {key!r}")
        if sub == GGUFValueType.ARRAY:
            raise cur.fail(f"key {key!r} is an array of arrays; nested arrays are not supported "
                           f"(llama.cpp refuses them too)")
        if sub not in _SCALAR and sub != GGUFValueType.STRING:
            raise cur.fail(f"key {key!r} has array element type {sub}, not a known GGUF value type (0..12)")
        min_size = 8 if sub == GGUFValueType.STRING else _SCALAR[sub][1]
        if n > cur.left() // min_size:
            raise cur.fail(f"key {key!r} claims {n} array elements of type {GGUFValueType(sub).name}, "
                           f"but only {cur.left()} bytes are left (at most {cur.left() // min_size})")
        if sub == GGUFValueType.STRING:
            return cur.strings(n, key), (vtype, sub)
        code, size = _SCALAR[sub]
        vals = cur.array(n, code, size)
        if sub == GGUFValueType.BOOL:
            vals = [bool(v) for v in vals]
        return vals, (vtype, sub)
    raise cur.fail(f"key {key!r} has value type {vtype}, not a known GGUF value type (0..12)")


def _type_sizes(cur: _Cursor, name: str, ggml_type: int) -> tuple[str, int, int]:
    try:
        qt = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has ggml type {ggml_type}, not a known type") from None
    return qt.name, block_size, type_size


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, int, str, tuple[int, ...], int, int]:
    name = cur.string(f"name of tensor {index}")
    if not name or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise cur.fail(f"tensor {index} name {name!r} must be 1..{MAX_NAME_BYTES} bytes")
    n_dims = cur.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has n_dims={n_dims}, must be 1..{MAX_DIMS}")
    shape = tuple(cur.u64(f"dim {j} of tensor {name!r}") for j in range(n_dims))
    n_elements = 1
    for j, d in enumerate(shape):
        if d < 1:
            raise cur.fail(f"tensor {name!r} dim {j} is {d}, must be >= 1")
        n_elements *= d
        if n_elements > INT64_MAX:
            raise cur.fail(f"tensor {name!r} shape {shape} has more than {INT64_MAX} elements")
    ggml_type = cur.u32(f"type of tensor {name!r}")
    type_name, block_size, type_size = _type_sizes(cur, name, ggml_type)
    if shape[0] % block_size:
        raise cur.fail(f"tensor {name!r} of type {type_name} has row length {shape[0]}, "
                       f"not a multiple of its block size {block_size}")
    n_bytes = n_elements // block_size * type_size
    rel_offset = cur.u64(f"data offset of tensor {name!r}")
    return name, ggml_type, type_name, shape, n_bytes, rel_offset


@dataclass
class _Shard:
    path: str
    mm: mmap.mmap | None
    metadata: dict
    value_types: dict
    tensors: dict


def _parse_shard(path: str) -> _Shard:
    try:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror}") from None
    try:
        if size < 24:
            raise GGUFError(f"{path}: truncated: {size} bytes, a GGUF header needs at least 24")
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        return _parse_buffer(path, mm, size)
    except BaseException:
        mm.close()
        raise


def _parse_buffer(path: str, mm: mmap.mmap, size: int) -> _Shard:
    cur = _Cursor(mm, path, size)
    magic = bytes(mm[0:4])
    cur.pos = 4
    if magic != GGUF_MAGIC:
        raise cur.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version:
        raise cur.fail(f"version field is {version:#x}: a big-endian GGUF file, only little-endian is supported")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata kv count")
    if n_tensors > cur.left() // MIN_TENSOR_INFO_BYTES:
        raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left()} bytes left "
                       f"(at most {cur.left() // MIN_TENSOR_INFO_BYTES})")
    if n_kv > cur.left() // MIN_KV_BYTES:
        raise cur.fail(f"metadata kv count {n_kv} cannot fit in the {cur.left()} bytes left "
                       f"(at most {cur.left() // MIN_KV_BYTES})")
    metadata: dict[str, object] = {}
    value_types: dict[str, tuple[int, int | None]] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if not key:
            raise cur.fail(f"key {i} is empty")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r} (kv {i})")
        metadata[key], value_types[key] = _read_value(cur, key, cur.u32(f"value type of {key!r}"))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and value_types["general.alignment"][0] != GGUFValueType.UINT32:
        raise cur.fail("general.alignment must be a uint32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment}, must be a power of 2")
    raw = []
    seen: set[str] = set()
    for i in range(n_tensors):
        info = _read_tensor_info(cur, i)
        if info[0] in seen:
            raise cur.fail(f"duplicate tensor name {info[0]!r} (tensor {i})")
        seen.add(info[0])
        raw.append(info)
    data_start = -(-cur.pos // alignment) * alignment if n_tensors else cur.pos
    tensors: dict[str, TensorInfo] = {}
    expected = 0
    for name, ggml_type, type_name, shape, n_bytes, rel in raw:
        if rel % alignment:
            raise cur.fail(f"tensor {name!r} has data offset {rel}, not a multiple of general.alignment {alignment}")
        if rel != expected:   # llama.cpp requires tensors packed in order at the alignment
            raise cur.fail(f"tensor {name!r} has data offset {rel}, expected {expected} "
                           f"(tensors are packed in order, aligned to {alignment})")
        if data_start + rel + n_bytes > size:
            raise cur.fail(f"truncated: tensor {name!r} ({n_bytes} bytes at offset {data_start + rel}) "
                           f"ends past the file end ({size} bytes)")
        tensors[name] = TensorInfo(name, ggml_type, type_name, shape, n_bytes, data_start + rel, path)
        expected = rel + -(-n_bytes // alignment) * alignment
    return _Shard(path, mm, metadata, value_types, tensors)


def _split_paths(path: str) -> list[str]:
    """The shard list for `path`, or [path] when it is not (the first of) a split set."""
    m = SPLIT_RE.match(os.path.basename(path))
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if count < 1 or not 1 <= no <= count:
        raise GGUFError(f"{path}: split name says shard {no} of {count}, which is not a valid shard")
    folder = os.path.dirname(path)
    if no != 1:
        first_name = f"{m['prefix']}-00001-of-{count:05d}.gguf"
        raise GGUFError(f"{path}: this is shard {no} of {count} of a split model; "
                        f"open the first shard instead: {os.path.join(folder, first_name)}")
    return [os.path.join(folder, f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """An open GGUF model: merged metadata (from the first shard) and every shard's tensors."""

    def __init__(self, path: str):
        self.path = str(path)
        self.shards = _split_paths(self.path)
        missing = [p for p in self.shards if not os.path.exists(p)]
        if missing and len(self.shards) > 1:
            raise GGUFError(f"{self.path}: split model of {len(self.shards)} shards is missing "
                            f"{len(missing)}: {', '.join(missing)}")
        self._open: list[_Shard] = []
        try:
            for p in self.shards:
                self._open.append(_parse_shard(p))
            self._check_split()
            self.tensors: dict[str, TensorInfo] = self._merge_tensors()
        except GGUFError as e:
            self.close()
            if str(e).startswith(self.path + ":"):
                raise
            raise GGUFError(f"{self.path}: split set refused: {e}") from None
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, object] = self._open[0].metadata
        self.value_types: dict[str, tuple[int, int | None]] = self._open[0].value_types  # (type, array subtype)
        self._by_path = {s.path: s for s in self._open}

    def _merge_tensors(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for shard in self._open:
            for name, info in shard.tensors.items():
                if name in tensors:
                    raise GGUFError(f"{shard.path}: tensor {name!r} is also in {tensors[name].path}")
                tensors[name] = info
        want = self._open[0].metadata.get("split.tensors.count")
        if want is not None and want != len(tensors):
            raise GGUFError(f"{self.path}: split.tensors.count is {want}, the shards hold {len(tensors)}")
        return tensors

    def _check_split(self) -> None:
        n = len(self.shards)
        for i, shard in enumerate(self._open):
            no, count = shard.metadata.get("split.no"), shard.metadata.get("split.count")
            if n == 1:
                if count not in (None, 0, 1) or no not in (None, 0):
                    raise GGUFError(f"{shard.path}: metadata says split.no={no} split.count={count}, but the "
                                    f"file name does not follow PREFIX-00001-of-{count or 0:05d}.gguf")
                continue
            if no != i or count != n:
                raise GGUFError(f"{shard.path}: split.no={no} split.count={count} do not match its name "
                                f"(shard {i + 1} of {n}, so split.no={i} split.count={n})")

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError(f"{self.path}: general.architecture is missing or not a string ({arch!r})")
        return arch

    def tensor_data(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        shard = self._by_path[info.path]
        if shard.mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        # ACCESS_READ mapping: the array is read-only, writes raise ValueError
        return np.frombuffer(shard.mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset)  # [n_bytes]

    def close(self) -> None:
        for shard in self._open:
            if shard.mm is not None:
                try:
                    shard.mm.close()
                except BufferError:
                    pass   # arrays still view it; the mapping goes when they do
                shard.mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_gguf(path: str) -> GGUFFile:
    """Open a GGUF file; the first shard of a split set opens every shard."""
    return GGUFFile(os.fspath(path))

"""The wire codec: openpi's msgpack + numpy encoding, decoded strictly.

Arrays travel as openpi encodes them (``openpi_client.msgpack_numpy``), not as a msgpack
ExtType: a map with bin keys ``b"__ndarray__": True, b"data": <C-order bytes>,
b"dtype": dtype.str, b"shape": [...]``; numpy scalars as ``b"__npgeneric__": True,
b"data": item, b"dtype": dtype.str``.

``pack`` produces exactly the bytes ``openpi_client.msgpack_numpy.packb`` produces, so
unmodified clients decode our replies. ``unpack`` decodes everything openpi's ``packb``
produces, but treats the frame as untrusted input:

1. the frame size is checked before anything is parsed;
2. a structure scan walks the msgpack headers (skipping string/bin payloads) and checks
   nesting depth, container lengths, string/bin lengths, the total element count, map key
   types, truncation, trailing bytes and ExtTypes, all before a single Python object is
   built, so a hostile frame cannot make the decoder allocate more than a bounded amount;
3. msgpack's C decoder then builds the objects (with its own ``max_*_len`` bounds as a
   second line of defence), and the object hook turns array/scalar marker maps into numpy
   values after validating dtype, shape and data length. Nothing is ever unpickled.

By default decoded arrays are *owned, writable, aligned, C-contiguous copies*. The server
decodes with ``copy=False`` instead: read-only C-contiguous views of the (immutable) frame
``bytes``, as openpi returns them, because it copies each camera array exactly once anyway -
into shared memory for the worker (``engine/shm.py``).

Every failure raises :class:`ProtocolError` with a one-line message.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import numpy as np

__all__ = ["DecodeLimits", "ProtocolError", "RequestError", "describe", "pack", "short_repr", "unpack"]

_MiB = 1024 * 1024

_NDARRAY_KEYS = frozenset({b"__ndarray__", b"data", b"dtype", b"shape"})
_NPGENERIC_KEYS = frozenset({b"__npgeneric__", b"data", b"dtype"})

# Type codes (kind + itemsize) the codec carries. Everything else (object, void/structured,
# complex, datetime/timedelta, unicode/bytes strings, float128, subarray dtypes) is refused.
_ALLOWED_CODES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")

# dtype strings accepted on the wire, mapped to the dtype they decode to. numpy's
# ``dtype.str`` writes "<" (little-endian) or "|" (byte order not applicable); "=" (native)
# is accepted from non-numpy clients. Big-endian (">") is refused. The table is built from
# these fixed strings so ``np.dtype`` never parses an untrusted one.
_WIRE_DTYPES: dict[str, np.dtype] = {prefix + code: np.dtype(prefix + code) for code in _ALLOWED_CODES for prefix in "<|="}
_ALLOWED_DTYPES = frozenset(_WIRE_DTYPES.values())
_ALLOWED_DTYPE_NAMES = "bool, int8..int64, uint8..uint64, float16/32/64, fixed-width strings U<n>/S<n>"
# Fixed-width strings (a session id sent as ``np.array(["ep-1"])``): "<U12", "|S12"; n is bounded
# and parsed here, so np.dtype never sees an untrusted string.
_STRING_DTYPE = re.compile(r"(?:[<=](U)|\|(S))([1-9][0-9]{0,3})")


class ProtocolError(ValueError):
    """A frame that cannot be encoded or decoded; the message is one specific line."""


class RequestError(ProtocolError):
    """A request whose known keys hold bad values; the message names the key (``openpi.py``, ``lingbot_va.py``, ``fields.py``, ``images.py``)."""


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds ``unpack`` enforces on one incoming frame.

    The defaults admit any RoboArena / DROID request (a few cameras with frame stacks of
    a few MiB, short strings, a handful of keys) with a wide margin while bounding what a
    hostile frame can cost: about twice ``max_message_bytes`` for array data (msgpack's
    bin copy, then ours) plus ``max_items`` small Python objects, and a structure scan of at
    most ``max_items`` headers (~0.3 us each: a pathological frame of tiny objects is refused
    within ~0.3 ms at the default, instead of stalling the event loop for every robot).
    """

    max_message_bytes: int = 64 * _MiB  # whole frame; matches the websocket frame bound (docs/spec.md §3)
    max_depth: int = 16  # container nesting; a request map -> array marker -> shape list is 3
    max_array_bytes: int = 64 * _MiB  # one array's data (also bounds any msgpack bin)
    max_array_ndim: int = 5  # (T, H, W, C) frame stacks are 4-D; one spare axis
    max_map_len: int = 4096  # entries in one map
    max_list_len: int = 65536  # elements in one list
    max_str_len: int = 1 * _MiB  # bytes of one UTF-8 string
    max_items: int = 1024  # list elements + map keys/values in the whole frame (a DROID request has < 100)

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"DecodeLimits.{field.name} must be a positive int, got {value!r}")


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    """Encode ``obj`` exactly as ``openpi_client.msgpack_numpy.packb`` does.

    Arrays and numpy scalars of dtypes ``unpack`` would refuse (object, void, complex,
    strings, datetimes, big-endian, ...) raise ProtocolError instead of being sent.
    """
    try:
        # Same call as openpi's ``functools.partial(msgpack.packb, default=pack_array)``:
        # identical options give identical bytes.
        return msgpack.packb(obj, default=_encode_numpy)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode message: {exc}") from None


def _encode_numpy(obj: Any) -> dict[bytes, Any]:
    """msgpack ``default`` hook: openpi's marker maps for numpy arrays and scalars."""
    if isinstance(obj, np.ndarray):
        _check_encodable_dtype(obj.dtype, "array")
        # tobytes() is C order even for non-contiguous views, as in openpi.
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        _check_encodable_dtype(obj.dtype, "numpy scalar")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    if isinstance(obj, int):  # msgpack hands back ints it cannot fit in 64 bits
        raise ProtocolError(f"cannot encode integer {short_repr(obj)}: msgpack integers are limited to 64 bits")
    raise ProtocolError(f"cannot encode object of type {type(obj).__name__}: expected dict, list, str, bytes, number, None or ndarray")


def _check_encodable_dtype(dtype: np.dtype, what: str) -> None:
    if dtype not in _ALLOWED_DTYPES or dtype.byteorder == ">":
        raise ProtocolError(f"cannot encode {what} of dtype {dtype.str!r} ({dtype}): allowed are {_ALLOWED_DTYPE_NAMES}, little-endian")


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


def unpack(data: bytes | bytearray | memoryview, limits: DecodeLimits = DecodeLimits(), *, copy: bool = True) -> Any:
    """Decode one frame produced by openpi's ``packb`` (or ``pack``) into Python/numpy values.

    ``limits`` defaults to one shared ``DecodeLimits()``; it is frozen, so sharing is safe.
    ``copy=False``: arrays are read-only views of the frame instead of owned copies.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected a binary frame (bytes), got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > limits.max_message_bytes:
        raise ProtocolError(f"message is {size} bytes, over the limit of {limits.max_message_bytes} bytes")
    if size == 0:
        raise ProtocolError("empty message: expected a msgpack-encoded request")
    data = bytes(data)  # no copy for bytes; a private snapshot of a mutable buffer
    _scan_structure(data, limits)
    try:
        return msgpack.unpackb(
            data,
            object_hook=functools.partial(_decode_marker_map, limits=limits, copy=copy),
            ext_hook=_refuse_ext,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_array_bytes,
            max_array_len=limits.max_list_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"malformed message: a string is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, TypeError, OverflowError, MemoryError, msgpack.UnpackException) as exc:
        # The scan accepted the structure, so this is unexpected; still a protocol error.
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ExtType {code} is not allowed: arrays use openpi's map encoding")


# First byte of a msgpack object -> (kind, bytes of its big-endian length field, inline
# value). For "int"/"float"/"nil"/"bool" the inline value is the payload size; for fix*
# types it is the length or element count; sized types read it from the length field.
_HEADERS: list[tuple[str, int, int]] = [("invalid", 0, 0)] * 256
for _tag in range(0x00, 0x80):
    _HEADERS[_tag] = ("int", 0, 0)
for _tag in range(0xE0, 0x100):
    _HEADERS[_tag] = ("int", 0, 0)
for _tag in range(0x80, 0x90):
    _HEADERS[_tag] = ("map", 0, _tag & 0x0F)
for _tag in range(0x90, 0xA0):
    _HEADERS[_tag] = ("array", 0, _tag & 0x0F)
for _tag in range(0xA0, 0xC0):
    _HEADERS[_tag] = ("str", 0, _tag & 0x1F)
for _tag in range(0xC7, 0xCA):
    _HEADERS[_tag] = ("ext", 0, 0)
for _tag in range(0xD4, 0xD9):
    _HEADERS[_tag] = ("ext", 0, 0)
_HEADERS[0xC0] = ("nil", 0, 0)
_HEADERS[0xC2] = _HEADERS[0xC3] = ("bool", 0, 0)
_HEADERS[0xCA], _HEADERS[0xCB] = ("float", 0, 4), ("float", 0, 8)
for _tag, _size in zip(range(0xCC, 0xD0), (1, 2, 4, 8), strict=True):
    _HEADERS[_tag] = ("int", 0, _size)  # uint8..uint64
    _HEADERS[_tag + 4] = ("int", 0, _size)  # int8..int64
for _tag, _size in zip(range(0xC4, 0xC7), (1, 2, 4), strict=True):
    _HEADERS[_tag] = ("bin", _size, 0)
for _tag, _size in zip(range(0xD9, 0xDC), (1, 2, 4), strict=True):
    _HEADERS[_tag] = ("str", _size, 0)
_HEADERS[0xDC], _HEADERS[0xDD] = ("array", 2, 0), ("array", 4, 0)
_HEADERS[0xDE], _HEADERS[0xDF] = ("map", 2, 0), ("map", 4, 0)
del _tag, _size


# The same table as small ints for the scan's inner loop (string compares cost ~10% there).
_KIND_CODES = {"invalid": 0, "ext": 1, "nil": 2, "bool": 2, "int": 2, "float": 2, "str": 3, "bin": 4, "array": 5, "map": 6}
_TAG_KIND = tuple(_KIND_CODES[kind] for kind, _, _ in _HEADERS)
_TAG_LENGTH_BYTES = tuple(length_bytes for _, length_bytes, _ in _HEADERS)
_TAG_VALUE = tuple(value for _, _, value in _HEADERS)
_STR, _BIN, _ARRAY, _MAP = 3, 4, 5, 6


def _scan_structure(data: bytes, limits: DecodeLimits) -> None:
    """Validate the msgpack structure of ``data`` without building any objects.

    Walks object headers iteratively (no recursion), skipping str/bin payloads, so the
    cost is proportional to the number of objects, which ``limits.max_items`` bounds. It runs
    on every request, so the loop is written for speed: int kind codes, locals, no helper calls
    on the common path.
    """
    end = len(data)
    pos = 0
    items = 0
    max_items, max_str, max_bin = limits.max_items, limits.max_str_len, limits.max_array_bytes
    tag_kind, tag_length_bytes, tag_value = _TAG_KIND, _TAG_LENGTH_BYTES, _TAG_VALUE
    # The container being read: objects still to read in it, whether it is a map; enclosing
    # ones on the stack. The root is a pseudo-container holding exactly one object.
    remaining, in_map = 1, False
    enclosing: list[tuple[int, bool]] = []
    while True:
        if remaining == 0:
            if not enclosing:
                break
            remaining, in_map = enclosing.pop()
            continue
        remaining -= 1
        if pos >= end:
            raise ProtocolError(f"truncated message: expected another object at byte {pos}, message is {end} bytes")
        tag = data[pos]
        kind = tag_kind[tag]
        if kind <= 1:
            if kind == 0:
                raise ProtocolError(f"malformed message: byte 0x{tag:02x} at offset {pos} is not a msgpack type")
            raise ProtocolError(f"msgpack ExtType (byte 0x{tag:02x} at offset {pos}) is not allowed: arrays use openpi's map encoding")
        if in_map and remaining % 2 and kind != _STR and kind != _BIN:  # a map key: odd count left after it
            raise ProtocolError(f"map key at offset {pos} must be a string, got msgpack {_HEADERS[tag][0]}")
        length_bytes = tag_length_bytes[tag]
        if length_bytes:
            header_end = pos + 1 + length_bytes
            if header_end > end:
                raise ProtocolError(f"truncated message: {_HEADERS[tag][0]} header at offset {pos} runs past the end ({end} bytes)")
            value = int.from_bytes(data[pos + 1 : header_end], "big")
            pos = header_end
        else:
            value = tag_value[tag]
            pos += 1
        if kind >= _ARRAY:
            count = value * 2 if kind == _MAP else value
            _check_container(_HEADERS[tag][0], value, count, pos, end, len(enclosing) + 1, limits)
            items += count
            if items > max_items:
                raise ProtocolError(f"message has more than {max_items} list elements and map entries in total")
            enclosing.append((remaining, in_map))
            remaining, in_map = count, kind == _MAP
            continue
        if kind == _STR and value > max_str:
            raise ProtocolError(f"string of {value} bytes at offset {pos} is over the limit of {max_str} bytes")
        if kind == _BIN and value > max_bin:
            raise ProtocolError(f"binary of {value} bytes at offset {pos} is over the limit of {max_bin} bytes")
        if pos + value > end:
            raise ProtocolError(f"truncated message: {_HEADERS[tag][0]} of {value} bytes at offset {pos} runs past the end ({end} bytes)")
        pos += value
    if pos != end:
        raise ProtocolError(f"malformed message: {end - pos} trailing bytes after the message ends at offset {pos}")


def _check_container(kind: str, length: int, count: int, pos: int, end: int, depth: int, limits: DecodeLimits) -> None:
    """Bounds for one map/array header; ``depth`` is the nesting level it opens."""
    if depth > limits.max_depth:
        raise ProtocolError(f"message nests deeper than {limits.max_depth} levels")
    noun, max_len = ("map", limits.max_map_len) if kind == "map" else ("list", limits.max_list_len)
    if length > max_len:
        raise ProtocolError(f"{noun} of {length} entries is over the limit of {max_len}")
    # Every element takes at least one byte: a count the rest of the frame cannot hold is a
    # truncated (or lying) frame; catching it here avoids building a huge list first.
    if count > end - pos:
        raise ProtocolError(f"truncated message: {kind} at offset {pos} declares {length} entries but only {end - pos} bytes remain")


def _decode_marker_map(obj: dict[Any, Any], limits: DecodeLimits, copy: bool = True) -> Any:
    """msgpack ``object_hook``: openpi's array/scalar marker maps -> numpy; others unchanged."""
    if b"__ndarray__" in obj:
        return _decode_ndarray(obj, limits, copy)
    if b"__npgeneric__" in obj:
        return _decode_npgeneric(obj)
    return obj


def _decode_ndarray(obj: dict[Any, Any], limits: DecodeLimits, copy: bool = True) -> np.ndarray:
    if obj.keys() != _NDARRAY_KEYS or obj[b"__ndarray__"] is not True:  # one compare on the common path
        _check_marker_keys(obj, _NDARRAY_KEYS, "__ndarray__")
    dtype = _WIRE_DTYPES.get(obj[b"dtype"]) if type(obj[b"dtype"]) is str else None
    if dtype is None:
        dtype = _wire_dtype(obj[b"dtype"], "array")
    shape = _wire_shape(obj[b"shape"], limits)
    data = obj[b"data"]
    if type(data) is not bytes:
        raise ProtocolError(f"array data must be msgpack bin, got {type(data).__name__}")
    nbytes = math.prod(shape) * dtype.itemsize  # exact: Python ints, no overflow
    if nbytes > limits.max_array_bytes:
        limit = limits.max_array_bytes
        raise ProtocolError(f"array of shape {shape} and dtype {dtype.str} is {nbytes} bytes, over the limit of {limit}")
    if nbytes != len(data):
        raise ProtocolError(f"array of shape {shape} and dtype {dtype.str} needs {nbytes} data bytes, got {len(data)}")
    if dtype.kind == "b" and nbytes and np.frombuffer(data, dtype=np.uint8).max() > 1:
        raise ProtocolError("bool array data must hold only 0 and 1 bytes")
    array = np.ndarray(shape, dtype=dtype, buffer=data)  # read-only: data is bytes
    # An owned, writable, aligned copy unless asked for views (see module docstring).
    return array.copy(order="C") if copy else array


def _decode_npgeneric(obj: dict[Any, Any]) -> np.generic:
    _check_marker_keys(obj, _NPGENERIC_KEYS, "__npgeneric__")
    dtype = _wire_dtype(obj[b"dtype"], "numpy scalar")
    value = obj[b"data"]
    if dtype.kind in "US":
        wanted = str if dtype.kind == "U" else bytes
        if type(value) is not wanted or len(value) > dtype.itemsize // (4 if dtype.kind == "U" else 1):
            raise ProtocolError(f"numpy scalar of dtype {dtype.str} needs a {wanted.__name__} that fits it")
        return dtype.type(value)
    if dtype.kind == "b":
        if type(value) is not bool:
            raise ProtocolError(f"numpy scalar of dtype {dtype.str} needs a bool, got {type(value).__name__}")
        return dtype.type(value)
    if dtype.kind in "iu":
        if type(value) is not int:
            raise ProtocolError(f"numpy scalar of dtype {dtype.str} needs an int, got {type(value).__name__}")
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise ProtocolError(f"numpy scalar {value} is out of range for dtype {dtype.str} [{info.min}, {info.max}]")
        return dtype.type(value)
    if type(value) not in (int, float):
        raise ProtocolError(f"numpy scalar of dtype {dtype.str} needs a number, got {type(value).__name__}")
    with np.errstate(over="ignore"):  # a float beyond float16's range becomes inf, as numpy casts
        return dtype.type(value)


def _check_marker_keys(obj: dict[Any, Any], expected: frozenset[bytes], marker: str) -> None:
    missing = sorted(expected - obj.keys())
    if missing:
        raise ProtocolError(f"{marker} map is missing the key {missing[0]!r}")
    extra = [key for key in obj if key not in expected]
    if extra:
        raise ProtocolError(f"{marker} map has the unexpected key {short_repr(extra[0])}")
    if obj[marker.encode()] is not True:
        raise ProtocolError(f"{marker} marker must be true, got {short_repr(obj[marker.encode()])}")


def _wire_dtype(value: Any, what: str) -> np.dtype:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} dtype must be a string like '<f4', got {type(value).__name__}")
    dtype = _WIRE_DTYPES.get(value)
    string = _STRING_DTYPE.fullmatch(value) if dtype is None else None
    if string is not None:
        dtype = np.dtype(f"<U{int(string[3])}" if string[1] else f"|S{int(string[3])}")
    if dtype is None:
        expected = f"{_ALLOWED_DTYPE_NAMES} as numpy dtype.str, e.g. '<f4' or '|u1'"
        raise ProtocolError(f"{what} dtype {short_repr(value)} is not allowed: expected one of {expected}")
    return dtype


def _wire_shape(value: Any, limits: DecodeLimits) -> tuple[int, ...]:
    if type(value) is list and len(value) <= limits.max_array_ndim and all(type(d) is int and 0 <= d <= limits.max_array_bytes for d in value):
        return tuple(value)  # the common case, checked in one pass
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"array shape must be a list of ints, got {type(value).__name__}")
    if len(value) > limits.max_array_ndim:
        raise ProtocolError(f"array has {len(value)} dimensions, over the limit of {limits.max_array_ndim}")
    for dim in value:
        # type() not isinstance(): bool is an int subclass and is no dimension.
        if type(dim) is not int or dim < 0:
            raise ProtocolError(f"array shape must be a list of non-negative ints, got {short_repr(value)}")
        if dim > limits.max_array_bytes:
            raise ProtocolError(f"array dimension {dim} is over the limit of {limits.max_array_bytes}")
    return tuple(value)


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() cut to ``limit`` characters: messages stay one short line whatever a client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(value: Any) -> str:
    """What a value is, for "expected ..., got <this>" messages (arrays: dtype and shape; lists: their length)."""
    if isinstance(value, np.ndarray):
        return f"array of dtype {value.dtype} and shape {value.shape}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    return type(value).__name__

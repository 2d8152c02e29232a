"""The wire codec: byte-compatible with openpi-client, strict on everything it decodes."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from openpi_client import msgpack_numpy as openpi

from ardiff_server.wire.protocol import DecodeLimits, ProtocolError, pack, unpack

ALLOWED_DTYPES = [
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
]

DEFAULT_LIMITS = DecodeLimits()


def roboarena_observation(seed: int = 0) -> dict[str, Any]:
    """What a RoboArena/DROID client sends, plus every value kind the codec must carry."""
    rng = np.random.default_rng(seed)
    return {
        "observation/exterior_image_0_left": rng.integers(0, 256, (4, 18, 32, 3), dtype=np.uint8),
        "observation/exterior_image_1_left": rng.integers(0, 256, (18, 32, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (18, 32, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(7).astype(np.float32),
        "observation/cartesian_position": rng.standard_normal(6),  # float64
        "observation/gripper_position": np.array([0.25]),
        "prompt": "put the marker in the cup",
        "session_id": "0b6c2b1e-9d1f-4c44-a1a4-5b2f3f0e7c11-A",
        "endpoint": "infer",
        "extras": {
            "step": np.int64(3),
            "flag": np.bool_(True),
            "scale": np.float32(0.5),
            "half": np.float16(1.5),
            "f64": np.float64(2.5),  # a float subclass: msgpack packs it as a plain float
            "small": np.uint16(7),
            "nested": [1, -2, 2.5, None, True, "x", b"raw", [np.int8(-4), {"deep": np.zeros((2, 0), np.float32)}]],
        },
        "strided": np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2],
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "zero_d": np.array(3.0, dtype=np.float32),
        "bools": np.array([True, False, True]),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
    }


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Equal values of the same types, arrays compared by dtype, shape and contents."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{index}]")
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind == "f"), path
    elif isinstance(expected, (float, np.floating)) and np.isnan(expected):
        assert np.isnan(actual), path
    else:
        assert actual == expected, path


def ndarray_map(data: Any = b"", dtype: Any = "<f4", shape: Any = (0,)) -> dict[bytes, Any]:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def refused(data: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        unpack(data, limits)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- compatibility with openpi-client ------------------------------------------------------


def test_pack_is_byte_identical_to_openpi() -> None:
    observation = roboarena_observation()
    assert pack(observation) == openpi.packb(observation)
    reply = {"actions": np.zeros((24, 8), np.float32), "server_timing": {"infer_ms": 12.5, "prev_total_ms": 30.0}}
    assert pack(reply) == openpi.packb(reply)


def test_unpack_decodes_openpi_frames_like_openpi() -> None:
    observation = roboarena_observation()
    decoded = unpack(openpi.packb(observation))
    assert_same(decoded, openpi.unpackb(openpi.packb(observation)))
    # And those equal the original values (np.float64 -> float is msgpack's doing, in openpi too).
    assert np.array_equal(decoded["strided"], observation["strided"])
    assert decoded["extras"]["half"] == np.float16(1.5) and type(decoded["extras"]["half"]) is np.float16
    assert decoded["extras"]["f64"] == 2.5 and type(decoded["extras"]["f64"]) is float


def test_openpi_decodes_our_frames() -> None:
    observation = roboarena_observation(seed=1)
    assert_same(openpi.unpackb(pack(observation)), openpi.unpackb(openpi.packb(observation)))


def test_decoded_arrays_are_owned_writable_and_independent_of_the_input_buffer() -> None:
    frame = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    buffer = bytearray(openpi.packb({"image": frame}))
    image = unpack(buffer)["image"]
    assert image.flags.writeable and image.flags.owndata and image.flags.c_contiguous and image.flags.aligned
    buffer[:] = bytes(len(buffer))  # the server reuses its receive buffer
    assert np.array_equal(image, frame)
    image[0, 0, 0] = 255  # policies may modify their inputs in place


# --- pack refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, dtype_text",
    [
        (np.array([object()], dtype=object), "|O"),
        (np.zeros(2, dtype=np.complex128), "<c16"),
        (np.complex64(1 + 2j), "<c8"),
        (np.zeros(2, dtype="V4"), "|V4"),
        (np.zeros(2, dtype=[("a", "<f4")]), "|V4"),
        (np.array(["abc"]), "<U3"),
        (np.array([b"ab"]), "|S2"),
        (np.array(["2024-01-01"], dtype="datetime64[s]"), "<M8[s]"),
        (np.zeros(2, dtype=">f4"), ">f4"),
    ],
)
def test_pack_refuses_dtypes_unpack_would_refuse(value: Any, dtype_text: str) -> None:
    with pytest.raises(ProtocolError, match="cannot encode") as info:
        pack({"x": value})
    assert repr(dtype_text) in str(info.value)


@pytest.mark.parametrize("value, needle", [({1, 2}, "type set"), (object(), "type object"), (2**70, "64 bits")])
def test_pack_refuses_unsupported_objects(value: Any, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        pack({"x": value})


# --- unpack refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        msgpack.packb(msgpack.ExtType(1, b"abc")),
        msgpack.packb({"x": [msgpack.ExtType(42, b"\x00" * 20)]}),
        msgpack.packb({"t": msgpack.Timestamp(1, 0)}),  # timestamps are ExtType -1
    ],
)
def test_unpack_refuses_ext_types(frame: bytes) -> None:
    assert "ExtType" in refused(frame)


def test_fixed_width_strings_decode_without_np_dtype_seeing_untrusted_text() -> None:
    """Session ids may come as string arrays; ``<U<n>`` and ``|S<n>`` with a bounded n are allowed."""
    decoded = unpack(openpi.packb({"s": np.array(["ab", "cde"]), "b": np.array([b"xy"]), "g": np.str_("hi")}))
    assert decoded["s"].tolist() == ["ab", "cde"] and decoded["b"].tolist() == [b"xy"] and decoded["g"] == "hi"


@pytest.mark.parametrize(
    "dtype",
    ["|O", "<c16", "<c8", ">U3", "<U0", "<U99999", "<S2", "|V8", "<M8[s]", "<m8", ">f4", ">i8", "f4", "float32", "<f16", "", "<f4" * 40],
)
def test_unpack_refuses_dtypes_outside_the_allow_list(dtype: str) -> None:
    message = refused(msgpack.packb({"x": ndarray_map(dtype=dtype)}))
    assert "dtype" in message and "not allowed" in message
    assert len(message) < 250  # a hostile dtype string is not echoed in full


def test_unpack_refuses_non_string_dtype() -> None:
    assert "dtype must be a string" in refused(msgpack.packb({"x": ndarray_map(dtype=b"<f4")}))


@pytest.mark.parametrize(
    "shape, data, needle",
    [
        ([3], b"\x00" * 8, "needs 12 data bytes, got 8"),
        ([2, 2], b"\x00" * 20, "needs 16 data bytes, got 20"),
        ([-1], b"", "non-negative ints"),
        ([2.0], b"\x00" * 8, "non-negative ints"),
        ([True], b"\x00" * 4, "non-negative ints"),
        (["2"], b"\x00" * 8, "non-negative ints"),
        (3, b"\x00" * 12, "shape must be a list"),
        ([1] * 6, b"\x00" * 4, "6 dimensions"),
        ([10**12], b"", "array dimension 1000000000000 is over the limit"),
        ([2**32, 2**32, 0], b"", "over the limit"),
        ([4096, 4096, 4096], b"", "over the limit"),
    ],
)
def test_unpack_refuses_bad_shapes(shape: Any, data: bytes, needle: str) -> None:
    assert needle in refused(msgpack.packb({"x": ndarray_map(data=data, shape=shape)}))


def test_huge_declared_shape_fails_fast_without_allocating() -> None:
    import tracemalloc

    frame = msgpack.packb({"x": ndarray_map(data=b"\x00" * 16, dtype="|u1", shape=[1 << 20, 1 << 20, 3])})
    tracemalloc.start()
    started = time.perf_counter()
    assert "over the limit" in refused(frame)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.1 and peak < 1 << 20


@pytest.mark.parametrize(
    "marker, needle",
    [
        ({b"__ndarray__": True, b"dtype": "<f4", b"shape": [0]}, "missing the key b'data'"),
        ({**ndarray_map(), b"extra": 1}, "unexpected key b'extra'"),
        ({**ndarray_map(), "name": "x"}, "unexpected key 'name'"),
        ({**ndarray_map(), b"__ndarray__": 1}, "marker must be true"),
        (ndarray_map(data="text", shape=[0]), "data must be msgpack bin"),
        (ndarray_map(data=b"\x00\x02", dtype="|b1", shape=[2]), "only 0 and 1"),
        ({b"__npgeneric__": True, b"data": 300, b"dtype": "|i1"}, "out of range"),
        ({b"__npgeneric__": True, b"data": -1, b"dtype": "<u8"}, "out of range"),
        ({b"__npgeneric__": True, b"data": 1.5, b"dtype": "<i4"}, "needs an int"),
        ({b"__npgeneric__": True, b"data": 1, b"dtype": "|b1"}, "needs a bool"),
        ({b"__npgeneric__": True, b"data": "1", b"dtype": "<f4"}, "needs a number"),
        ({b"__npgeneric__": True, b"data": 1, b"dtype": "<c16"}, "not allowed"),
        ({b"__npgeneric__": True, b"data": 1}, "missing the key b'dtype'"),
    ],
)
def test_unpack_refuses_malformed_marker_maps(marker: dict[Any, Any], needle: str) -> None:
    assert needle in refused(msgpack.packb({"x": marker}))


def test_numpy_scalars_decode_to_their_dtype() -> None:
    frame = msgpack.packb(
        [
            {b"__npgeneric__": True, b"data": 2**64 - 1, b"dtype": "<u8"},
            {b"__npgeneric__": True, b"data": 1e10, b"dtype": "<f2"},
        ]
    )
    big, half = unpack(frame)
    assert type(big) is np.uint64 and big == 2**64 - 1
    assert type(half) is np.float16 and np.isinf(half)  # numpy's own cast, without a warning


def test_nesting_depth_is_bounded() -> None:
    limits = DecodeLimits(max_depth=16)
    value: Any = 1
    for _ in range(16):
        value = [value]
    assert unpack(msgpack.packb(value), limits) == value
    assert "deeper than 16" in refused(msgpack.packb([value]), limits)
    # msgpack's own recursion limit is never reached: the scan stops at max_depth.
    assert "deeper than 16" in refused(b"\x91" * 100_000 + b"\x01", limits)


def test_message_size_is_checked_before_decoding() -> None:
    frame = msgpack.packb({"x": "a" * 200})
    assert unpack(frame, DecodeLimits(max_message_bytes=len(frame))) == {"x": "a" * 200}
    assert f"message is {len(frame)} bytes, over the limit of 100" in refused(frame, DecodeLimits(max_message_bytes=100))


@pytest.mark.parametrize(
    "value, limits, needle",
    [
        ("a" * 101, DecodeLimits(max_str_len=100), "string of 101 bytes"),
        (b"a" * 101, DecodeLimits(max_array_bytes=100), "binary of 101 bytes"),
        (list(range(11)), DecodeLimits(max_list_len=10), "list of 11 entries is over the limit of 10"),
        ({str(i): i for i in range(11)}, DecodeLimits(max_map_len=10), "map of 11 entries is over the limit of 10"),
        ([[0] * 8] * 8, DecodeLimits(max_items=50), "more than 50 list elements"),
        ({"x": np.zeros(26, np.float32)}, DecodeLimits(max_array_bytes=100), "over the limit of 100"),
        ({"x": np.zeros((1,) * 6, np.uint8)}, DecodeLimits(), "6 dimensions, over the limit of 5"),
    ],
)
def test_size_limits(value: Any, limits: DecodeLimits, needle: str) -> None:
    assert needle in refused(pack(value), limits)


def test_declared_lengths_the_frame_cannot_hold_fail_fast() -> None:
    for frame in (
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\x00\x01\x00\x00\x01",
        b"\xc6\xff\xff\xff\xff",
        b"\xdb\x00\x0f\xff\xff",
    ):
        started = time.perf_counter()
        message = refused(frame)
        assert time.perf_counter() - started < 0.05
        assert "truncated" in message or "over the limit" in message


def test_default_item_budget_bounds_the_cost_of_tiny_objects() -> None:
    inner = b"\xdc\xff\xff" + b"\x90" * 65535  # a list of 65535 empty lists: 3 bytes -> 64 bytes each
    started = time.perf_counter()
    assert "more than 1024" in refused(b"\x95" + inner * 5)
    assert time.perf_counter() - started < 1.0


def test_truncated_frames_are_refused_at_every_cut() -> None:
    frame = openpi.packb(roboarena_observation())
    for cut in range(0, len(frame), max(1, len(frame) // 300)):
        assert refused(frame[:cut])


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"", "empty message"),
        (b"\xc1", "0xc1"),
        (b"\x01\x02", "trailing bytes"),
        (b"\xa2\xff\xfe", "not valid UTF-8"),
        (msgpack.packb({1: 2}), "map key at offset 1 must be a string, got msgpack int"),
        (msgpack.packb({"ok": {None: 2}}), "must be a string, got msgpack nil"),
        (msgpack.packb([{1.5: 2}]), "got msgpack float"),
    ],
)
def test_unpack_refuses_malformed_msgpack(frame: bytes, needle: str) -> None:
    assert needle in refused(frame)


def test_unpack_refuses_non_bytes_input() -> None:
    with pytest.raises(ProtocolError, match="expected a binary frame"):
        unpack("text frame")  # type: ignore[arg-type]


def test_decode_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        DecodeLimits(max_depth=0)


# --- property tests --------------------------------------------------------------------------

allowed_arrays = hnp.arrays(
    dtype=st.sampled_from(ALLOWED_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
)


@settings(max_examples=150, deadline=None)
@given(array=allowed_arrays, transpose=st.booleans())
def test_random_allowed_arrays_round_trip_from_openpi(array: np.ndarray, transpose: bool) -> None:
    if transpose:
        array = array.T  # non-contiguous input still encodes as C-order bytes
    frame = openpi.packb({"x": array})
    assert pack({"x": array}) == frame
    decoded = unpack(frame)["x"]
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    assert np.array_equal(decoded, array, equal_nan=array.dtype.kind == "f")


@settings(max_examples=100, deadline=None)
@given(scalar=st.sampled_from(ALLOWED_DTYPES).flatmap(lambda dtype: hnp.from_dtype(dtype).map(dtype.type)))
def test_random_numpy_scalars_round_trip_from_openpi(scalar: np.generic) -> None:
    assert_same(unpack(pack([scalar])), openpi.unpackb(openpi.packb([scalar])))


def _only_protocol_errors(frame: bytes) -> None:
    try:
        unpack(frame)
    except ProtocolError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=400, deadline=None)
@given(frame=st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_protocol_errors(frame: bytes) -> None:
    _only_protocol_errors(frame)


_wire_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=16),
)
_dtype_strings = st.sampled_from(["<f4", "|u1", "|b1", "<i8", "<f2", "|O", "<c16", "<U3", ">f4", "V", ""]) | st.text(max_size=6)
_shapes = st.lists(st.one_of(st.integers(min_value=-3, max_value=2**40), st.floats(), st.text(max_size=2)), max_size=7) | _wire_leaves
_marker_maps = st.fixed_dictionaries(
    {
        b"__ndarray__": st.sampled_from([True, False, 1]),
        b"data": st.binary(max_size=32) | _wire_leaves,
        b"dtype": _dtype_strings | _wire_leaves,
        b"shape": _shapes,
    }
) | st.fixed_dictionaries({b"__npgeneric__": st.sampled_from([True, 1]), b"data": _wire_leaves, b"dtype": _dtype_strings})
_junk = st.recursive(
    _wire_leaves | _marker_maps,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.one_of(st.text(max_size=6), st.binary(max_size=6), st.integers(-(2**63), 2**63 - 1), st.none()),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_junk)
def test_arbitrary_msgpack_junk_raises_only_protocol_errors(value: Any) -> None:
    _only_protocol_errors(msgpack.packb(value))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_openpi_frames_raise_only_protocol_errors(data: st.DataObject) -> None:
    frame = bytearray(openpi.packb({"img": np.zeros((2, 3, 3), np.uint8), "q": np.ones(7), "prompt": "go", "n": [1, 2.5]}))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _only_protocol_errors(bytes(frame[:cut]))

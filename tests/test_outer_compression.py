"""DiLoCo outer-gradient compression: round-trip error bounds, wire sizes, and the wire format replica processes
exchange (encode on the devices, decode on the host) reconstructing exactly what the in-program round trip does."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlm.diloco.compression import BITS, decode, encode, round_trip, wire_bytes


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 700),
    st.sampled_from([1, 16, 64, 256]),
    st.sampled_from(["int8", "int4"]),
    st.floats(1e-6, 1e3),
    st.integers(0, 2**31 - 1),
)
def test_int_round_trip_error_is_at_most_half_a_step_of_its_block(n, block, kind, magnitude, seed):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * magnitude
    got = np.asarray(round_trip(x, kind, block))
    qmax = 127 if kind == "int8" else 7
    padded = np.pad(x, (0, -n % block)).reshape(-1, block)
    step = np.repeat(np.abs(padded).max(axis=1) / qmax, block)[:n]
    assert got.shape == x.shape and got.dtype == np.float32
    assert np.all(np.abs(got - x) <= step / 2 * (1 + 1e-5) + 1e-30)
    # the largest value of each block is exact up to float rounding (its scale is chosen from it)
    i = int(np.argmax(np.abs(x)))
    assert got[i] == pytest.approx(x[i], rel=1e-6)


def test_bf16_round_trip_keeps_eight_bits_of_mantissa_and_none_is_exact():
    x = np.random.default_rng(0).standard_normal((33, 7)).astype(np.float32)
    assert np.max(np.abs(np.asarray(round_trip(x, "bf16")) - x) / np.abs(x)) <= 2.0**-8
    assert np.array_equal(np.asarray(round_trip(x, "none")), x)


def test_zero_blocks_stay_zero():
    x = np.zeros(300, np.float32)
    x[280] = 5.0
    got = np.asarray(round_trip(x, "int4", 128))
    assert np.all(got[:256] == 0) and got[280] == pytest.approx(5.0)


def test_wire_bytes_are_bits_over_eight_plus_one_scale_per_block():
    n = 1_000_000
    assert wire_bytes(n, "none") == (4 * n, 0)
    assert wire_bytes(n, "bf16") == (2 * n, 0)
    assert wire_bytes(n, "int8", 256) == (n, 4 * 3907)
    assert wire_bytes(n, "int4", 256) == (n // 2, 4 * 3907)
    assert wire_bytes(3, "int4", 256) == (2, 4)
    assert set(BITS) == {"none", "bf16", "int8", "int4"}


@pytest.mark.parametrize("kind, block, message", [("int2", 8, "int2"), ("int8", 0, "block")])
def test_bad_settings_are_named(kind, block, message):
    with pytest.raises(ValueError, match=message):
        round_trip(np.ones(3), kind, block)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=3),
    st.sampled_from(list(BITS)),
    st.sampled_from([1, 7, 64]),
    st.integers(0, 2**31 - 1),
)
def test_encoded_wire_format_decodes_to_the_round_trip_and_has_its_size(shape, kind, block, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x.flat[0] = 0.0
    parts = jax.device_get(jax.jit(lambda v: encode(v, kind, block))(x))
    got = decode(parts, kind, tuple(shape), block)
    # equal values, bit for bit, when both are compiled (as in the programs: eager division may round differently)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(lambda v: round_trip(v, kind, block))(x)))
    assert sum(v.nbytes for v in parts.values()) == sum(wire_bytes(x.size, kind, block))

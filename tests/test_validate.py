"""The shared number checks (offload.config.validate): whatever is passed, a value that is
taken is within its range and usable (its bytes an int64), and anything else is one
ConfigError line naming the argument and the value; never another exception."""

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from junk import JUNK

from offload.config.limits import MAX_GIB, MAX_INT
from offload.config.validate import flag, gib, integer, is_integer, real, whole_number
from offload.errors import ConfigError
from offload.sizes import GIB

# Values near every edge: huge and tiny, signed zeros, infinities, nan, bools, text.
_EDGES = st.sampled_from(
    [
        *(0, -0.0, 0.0, 1, -1, True, False, 2**63 - 1, 2**63, 2**64, 2**70, 10**400, 1e300),
        *(MAX_GIB, MAX_GIB + 1, float(MAX_GIB) * 1.5, 5e-324, math.inf, -math.inf, math.nan),
    ]
)
VALUES = st.one_of(JUNK, _EDGES)
_BOUNDS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False))


def _names(error: ConfigError, name: str) -> bool:
    """Whether `error` is one line that names the argument and the value given."""
    message = str(error)
    return message.startswith(f"{name} must be ") and ", got " in message and "\n" not in message


def _float(value: int | float) -> float:
    """`value` as a float; an int beyond float's range as infinity (as `real` takes it)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@given(value=VALUES, low=_BOUNDS, span=_BOUNDS, finite=st.booleans())
@example(value=10**1000, low=8.988465674311579e307, span=8.98846567431158e307, finite=False)
def test_real_takes_a_number_in_its_range_and_refuses_the_rest_by_name(value, low, span, finite):
    high = low + abs(span)
    try:
        number = real("x", value, low, high, finite=finite)
    except ConfigError as error:
        assert _names(error, "x")
        return
    assert _is_real(value) and isinstance(number, float)
    assert low <= number <= high and number == _float(value)
    assert math.copysign(1.0, number) == 1.0 or number < 0  # -0.0 comes back as 0.0


@given(value=VALUES, low=st.floats(0, 10), low_open=st.booleans(), text=st.booleans())
def test_a_gib_amount_taken_is_finite_and_its_bytes_an_int64(value, low, low_open, text):
    try:
        amount = gib("memory_gb", value, low, low_open=low_open, text=text)
    except ConfigError as error:
        assert _names(error, "memory_gb")
        return
    assert math.isfinite(amount) and low <= amount <= MAX_GIB
    assert int(amount * GIB) <= 2**63  # the conversion every budget makes cannot overflow
    assert _is_real(value) or (text and isinstance(value, str))


@given(value=VALUES, low=st.integers(-(2**64), 2**64), high=st.none() | st.integers(0, 2**65))
def test_integer_takes_exactly_the_ints_in_range(value, low, high):
    top = MAX_INT if high is None else high
    wanted = is_integer(value, low, top)
    assert wanted == (
        isinstance(value, int) and not isinstance(value, bool) and low <= value <= top
    )
    try:
        assert integer("count", value, low, high) is value and wanted
    except ConfigError as error:
        assert not wanted and _names(error, "count")
        if isinstance(value, int) and value > top and high is None:
            assert f"at most {MAX_INT}" in str(error)


@given(value=VALUES, low=st.integers(0, 3))
def test_a_config_count_is_an_integral_number_within_int64(value, low):
    try:
        count = whole_number("part.count", value, low)
    except ConfigError as error:
        assert _names(error, "part.count")
        return
    assert type(count) is int and low <= count <= MAX_INT
    assert count == (float(value) if isinstance(value, str) else value)


@given(value=VALUES)
def test_flag_takes_bools_only(value):
    try:
        assert flag("switch", value) is value and isinstance(value, bool)
    except ConfigError as error:
        assert not isinstance(value, bool) and _names(error, "switch")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: real("t", math.nan, 0.0, 2.0), "t must be a number, got nan"),
        (lambda: real("t", math.inf, 0.0, 2.0), "t must be in [0.0, 2.0], got inf"),
        (lambda: real("s", "x", 0, 1, low_open=True, finite=True), "s must be a number in (0, 1]"),
        (lambda: gib("g", -1.0), "g must be a finite number >= 0, got -1.0"),
        (lambda: gib("g", 1e300), "g must be a finite number >= 0, at most 4294967296, got 1e+300"),
        (lambda: integer("n", 2**70, 1), "n must be an integer >= 1, at most 9223372036854775807"),
        (lambda: integer("n", True, 1), "n must be an integer >= 1, got True"),
        (lambda: whole_number("p.k", 1.5, 1), "p.k must be an integer >= 1, got 1.5"),
        (lambda: whole_number("p.k", 10**400, 0), "p.k must be a finite number >= 0"),
        (lambda: integer("n", 10**5000, 1), "n must be an integer >= 1, at most"),
    ],
)
def test_messages_say_what_is_allowed(call, message):
    with pytest.raises(ConfigError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_minus_zero_is_zero_so_equal_configs_hash_alike():
    from offload.config import OffloadConfig

    config = OffloadConfig.from_dict({"cpu_offload_gb": -0.0, "cpu_memory_gb": -0.0})
    same = OffloadConfig.from_dict({"cpu_offload_gb": 0.0, "cpu_memory_gb": 0})
    assert config.compute_hash() == same.compute_hash()
    assert math.copysign(1.0, config.uva.cpu_offload_gb) == 1.0

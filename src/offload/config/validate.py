"""One way to check a number (and a switch). Every numeric field and argument goes through
these: the offload config's parts, `SamplingParams`, `LLM`'s arguments, the planner's
inputs, and through them the command's flags. A bad value raises `ConfigError`, one line
"{name} must be {what is allowed}, got {value}"; a value no one could mean (nan, infinity,
1e300 GiB, 2**70 sequences, True as a number) is refused here, before code deeper down
overflows on it."""

from __future__ import annotations

import math
import numbers

from offload.config.limits import MAX_GIB, MAX_INT
from offload.errors import ConfigError, shown


def refusal(name: str, value: object, allowed: str) -> ConfigError:
    """The error for `value` given as `name`."""
    return ConfigError(f"{name} must be {allowed}, got {shown(value)}")


def range_text(
    low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> str:
    """ ">= low" where there is no upper bound (None), else "in [low, high]" with each
    bracket open or closed."""
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def real(
    name: str,
    value: object,
    low: float = -math.inf,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = False,
    cap: float | None = None,
    text: bool = False,
    what: str | None = None,
) -> float:
    """`value` as a float (-0.0 as 0.0) when it is a real number (not a bool) in the range.

    `finite`: nan and infinity are refused as such ("a finite number >= 0"), as amounts and
    shares must be; otherwise nan is no number and infinity is judged by the range (a
    logit bias may be infinite). `cap`: the largest value the code can represent
    (`MAX_GIB`, `MAX_INT`), named only to a value beyond it. `text`: a string holding a
    number is taken too, as config files write them. `what` replaces the description of
    what is allowed in every message."""
    span = range_text(low, high, low_open=low_open, high_open=high_open)
    number = _as_float(value, text)
    if number is None or (math.isnan(number) and not finite):
        raise refusal(name, value, what or (f"a number {span}" if finite else "a number"))
    top = math.inf if high is None else high
    inside = (low < number if low_open else low <= number) and (
        number < top if high_open else number <= top
    )
    allowed = what or (f"a finite number {span}" if finite else span)
    if not inside or (finite and not math.isfinite(number)):
        raise refusal(name, value, allowed)
    exact = value if isinstance(value, int) else number  # int and float compare exactly
    if cap is not None and exact > cap:
        raise refusal(name, value, f"{allowed}, at most {cap}")
    return number + 0.0  # -0.0 is 0.0: a config's hash and flags do not tell them apart


def _as_float(value: object, text: bool) -> float | None:
    if text and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range (10**400) is infinite
        return math.inf if value > 0 else -math.inf


def integer(
    name: str, value: object, low: int, high: int | None = None, *, what: str | None = None
) -> int:
    """`value` when it is an int (not a bool, not a float) in [low, high]; `high` None:
    no bound but `MAX_INT`, named only to a value beyond it."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    top = MAX_INT if high is None else high
    if is_int and low <= value <= top:
        return value
    allowed = what or f"an integer {range_text(low, high)}"
    if is_int and high is None and value > top:
        allowed += f", at most {MAX_INT}"
    raise refusal(name, value, allowed)


def is_integer(value: object, low: int, high: int = MAX_INT) -> bool:
    """Whether `integer` takes `value` (for checks that answer yes or no)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def whole_number(name: str, value: object, low: int) -> int:
    """A config's count: an integer >= `low`, given as an int or as a float or a string
    that holds one (config files write 4.0 and "4")."""
    number = real(name, value, low, finite=True, cap=MAX_INT, text=True)
    if isinstance(value, int):
        return value  # exact, not through float
    if number != int(number):
        raise refusal(name, value, f"an integer {range_text(low)}")
    return int(number)


def gib(
    name: str,
    value: object,
    low: float = 0,
    *,
    low_open: bool = False,
    text: bool = False,
    what: str | None = None,
) -> float:
    """An amount of memory in GiB: a finite number >= `low` (> with `low_open`), at most
    `MAX_GIB` (its bytes stay a 64-bit integer)."""
    return real(name, value, low, low_open=low_open, finite=True, cap=MAX_GIB, text=text, what=what)


def flag(name: str, value: object, allowed: str = "True or False") -> bool:
    """`value` when it is a bool (1 and "yes" are not)."""
    if not isinstance(value, bool):
        raise refusal(name, value, allowed)
    return value

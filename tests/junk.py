"""Values of every wrong kind, for property tests of the input checks."""

from hypothesis import strategies as st

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2**64, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e400, 1e-300, 1e-45, float("nan")]),
    st.text(max_size=8),
    st.sampled_from(["nan", "inf", "1e400", "", "auto"]),
    st.binary(max_size=4),
)
# Scalars, and lists and dicts of them (one level deep, then nested once more).
JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
)

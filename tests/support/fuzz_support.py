"""Hypothesis strategies of hostile JSON values, shared by the fuzz tests: non-finite floats
(Python's json reads NaN / Infinity), integers past float range, lone surrogates ("\\ud800" is
valid JSON), nested junk."""
from hypothesis import HealthCheck, settings, strategies as st

# bounded, deterministic: each fuzz file runs in seconds
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_text = st.text(st.characters(codec=None, categories=None), max_size=8)
SCALAR = (st.none() | st.booleans() | st.integers() | st.integers(-2**1100, 2**1100)
          | st.floats(allow_nan=True, allow_infinity=True) | _text
          | st.sampled_from(["", "text", "user", "hi", 0, 1, -1, 2**64, 1e308, "\ud800", 10**400]))
JUNK = st.recursive(SCALAR, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.sampled_from(["role", "content", "type", "text",
                                                       "include_usage", "x"]) | _text, kids,
                                      max_size=4), max_leaves=12)
VALUE = st.one_of(SCALAR, JUNK)  # half scalars: the recursive strategy favours containers
# every field also meets each of these, deterministically
NASTY = [float("nan"), float("inf"), -float("inf"), 10**400, -10**400, 2**64, 10**18, -1, 0,
         True, 1.5, "x", "", "\ud800", [], [None], {}, {"x": [1]}, [[[[["deep"]]]]], [10**400],
         ["\ud800"]]

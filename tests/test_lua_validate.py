"""The argument checks every script runs (lua/include/validate.lua): what they accept, and
the error that names what is wrong with a value they refuse.

arg_num and arg_int test a value once on the common path and find which check failed only
for a refused value, so each refusal's message is pinned here, on a real Redis."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from limiter.scripts import lua_dir

VALIDATE = (lua_dir() / "include" / "validate.lua").read_text()
# ARGV[1] = 'int' | 'num', ARGV[2] = the value; bounds [0, 10]. The result as a string: a
# Lua number in a reply would be cut to an integer.
SCRIPT = VALIDATE + """
if ARGV[1] == 'int' then return tostring(arg_int(ARGV[2], 'x', 0, 10)) end
return tostring(arg_num(ARGV[2], 'x', 0, 10))
"""


def _check(sync_redis, kind: str, value: str) -> str:
    return sync_redis.eval(SCRIPT, 0, kind, value).decode()


@pytest.mark.parametrize(("kind", "value", "got"), [
    ("int", "0", "0"), ("int", "10", "10"), ("int", "7", "7"), ("int", "1e1", "10"),
    ("num", "0", "0"), ("num", "2.5", "2.5"), ("num", "10", "10"), ("num", "1e-3", "0.001"),
])
def test_a_value_in_bounds_is_returned_as_a_number(sync_redis, kind, value, got):
    assert _check(sync_redis, kind, value) == got


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("int", "abc", "BADARG x: not a number: abc"),
    ("int", "", "BADARG x: not a number: "),
    ("int", "nan", "BADARG x: not a number: nan"),
    ("num", "nan", "BADARG x: not a number: nan"),
    ("num", "inf", "BADARG x: not a number: inf"),
    ("num", "-inf", "BADARG x: not a number: -inf"),
    ("int", "1e400", "BADARG x: not a number: 1e400"),
    ("int", "11", "BADARG x: 11 is outside [0, 10]"),
    ("int", "-1", "BADARG x: -1 is outside [0, 10]"),
    ("num", "10.5", "BADARG x: 10.5 is outside [0, 10]"),
    ("int", "10.5", "BADARG x: 10.5 is outside [0, 10]"),  # out of bounds is said first
    ("int", "2.5", "BADARG x: not an integer: 2.5"),
])
def test_a_refused_value_gets_the_error_that_names_its_problem(sync_redis, kind, value, message):
    with pytest.raises(ResponseError) as caught:
        _check(sync_redis, kind, value)
    assert str(caught.value).startswith(message), str(caught.value)

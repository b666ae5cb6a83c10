"""Hypothesis strategies for OpenAI request bodies: near-valid values, with junk of every
JSON type, for each field (tests/test_http_fuzz.py, tests/test_frontend_bad_input.py)."""

from __future__ import annotations

from hypothesis import strategies as st

JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON = st.recursive(
    JSON_SCALAR,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=12,
)
JUNK = st.one_of(
    JSON_SCALAR,
    st.lists(JSON_SCALAR, max_size=3),
    st.dictionaries(st.text(max_size=4), JSON_SCALAR, max_size=2),
)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), JUNK)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", ""]),
        "content": st.one_of(st.text(max_size=20), st.lists(PART, max_size=3), JUNK),
    },
    optional={
        "name": st.one_of(st.text(max_size=5), JUNK),
        "tool_call_id": st.text(max_size=5),
        "mood": JUNK,
    },
)
FIELDS = {
    "model": st.one_of(
        st.just("tiny"), st.just("tiny"), st.sampled_from(["tiny ", "TINY", "{tiny}", "gpt-4"]), JUNK
    ),
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), JUNK),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=5), max_size=2), JUNK),
    "max_tokens": st.one_of(st.integers(-3, 50), st.integers(4000, 2**64), JUNK),
    "max_completion_tokens": st.one_of(st.integers(-1, 50), JUNK),
    "temperature": st.one_of(st.floats(-1, 3), JUNK),
    "top_p": st.one_of(st.floats(-0.5, 1.5), JUNK),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), JUNK),
    "seed": st.one_of(st.integers(-(2**65), 2**65), JUNK),
    "n": st.one_of(st.just(1), st.integers(2, 3), JUNK),
    "stream": st.one_of(st.booleans(), JUNK),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
    "user": st.one_of(st.text(max_size=5), JUNK),
    "logprobs": st.one_of(st.booleans(), st.just(0), JUNK),
    "logit_bias": st.one_of(st.just({}), JUNK),
    "frequency_penalty": st.one_of(st.just(0), JUNK),
    "response_format": st.one_of(st.just({"type": "text"}), JUNK),
    "echo": st.one_of(st.booleans(), JUNK),
    "suffix": st.one_of(st.just(""), JUNK),
    "priority": JUNK,  # not an OpenAI field here: 400, never a higher class
    "qos_class": st.sampled_from(["P0", "P1", "P2"]),
    "extra": JUNK,
}

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

# --- /v1/responses: Responses-shaped bodies, near valid, with junk in any field or part ----------


def _deep(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


# junk, and what JSON holds that a JSON encoder may not (an integer past 64 bits, a value
# nested deep), in any place
RJUNK = st.one_of(JUNK, st.sampled_from([2**64, -(2**65), [2**70], {"k": 2**66}, _deep(300)]))

_TEXT_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "text", ""]),
     "text": st.one_of(st.text(max_size=10), RJUNK)},
    optional={"annotations": st.one_of(st.just([]), RJUNK), "logprobs": st.one_of(st.just([]), RJUNK),
              "refusal": RJUNK},
)
_ITEM_CONTENT = st.one_of(st.text(max_size=20), st.lists(st.one_of(_TEXT_PART, RJUNK), max_size=3), RJUNK)
_ID = st.one_of(st.text(max_size=8), st.just("x" * 300), RJUNK)
_REASONING_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["reasoning_text", "summary_text", "text"]),
     "text": st.one_of(st.text(max_size=10), RJUNK)})
INPUT_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "", "robot"]),
         "content": _ITEM_CONTENT},
        optional={"type": st.sampled_from(["message", "message", "", "x"]), "id": _ID,
                  "status": st.sampled_from(["completed", "in_progress", "incomplete"]), "mood": RJUNK},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": _ID, "name": _ID,
         "arguments": st.one_of(st.just("{}"), st.text(max_size=10), RJUNK)},
        optional={"id": _ID, "status": RJUNK},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _ID, "output": _ITEM_CONTENT},
        optional={"id": _ID},
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={"id": _ID, "summary": st.one_of(st.lists(_REASONING_PART, max_size=2), RJUNK),
                  "content": st.one_of(st.lists(_REASONING_PART, max_size=2), RJUNK),
                  "encrypted_content": st.one_of(st.none(), st.just(""), RJUNK)},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["item_reference", "web_search_call", "file_search_call"])},
        optional={"id": _ID}),
    RJUNK,
)
_FUNCTION_TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "web_search", "mcp", ""]),
     "name": st.one_of(st.sampled_from(["f", "g", "get_weather", ""]), RJUNK)},
    optional={"description": st.one_of(st.text(max_size=8), RJUNK),
              "parameters": st.one_of(st.just({"type": "object"}), JSON),
              "strict": st.one_of(st.booleans(), RJUNK), "extra": RJUNK},
)
RESPONSES_FIELDS = {
    "model": FIELDS["model"],
    "input": st.one_of(st.text(max_size=30), st.lists(INPUT_ITEM, min_size=1, max_size=4), RJUNK),
    "instructions": st.one_of(st.text(max_size=10), RJUNK),
    "max_output_tokens": st.one_of(st.integers(-1, 40), st.integers(4000, 2**64), RJUNK),
    "temperature": FIELDS["temperature"],
    "top_p": FIELDS["top_p"],
    "stream": FIELDS["stream"],
    "stream_options": st.one_of(st.fixed_dictionaries({"include_obfuscation": st.booleans()}), RJUNK),
    "tools": st.one_of(st.lists(_FUNCTION_TOOL, max_size=3), RJUNK),
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "sometimes"]),
        st.fixed_dictionaries({"type": st.sampled_from(["function", "file_search"])},
                              optional={"name": st.one_of(st.sampled_from(["f", "g", ""]), RJUNK)}),
        RJUNK),
    "parallel_tool_calls": st.one_of(st.booleans(), RJUNK),
    "text": st.one_of(
        st.fixed_dictionaries({}, optional={
            "format": st.one_of(st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                optional={"name": st.one_of(st.just("A"), RJUNK), "schema": st.one_of(st.just({}), JSON),
                          "strict": st.one_of(st.booleans(), RJUNK)}), RJUNK),
            "verbosity": st.one_of(st.sampled_from(["low", "medium", "high"]), RJUNK)}),
        RJUNK),
    "reasoning": st.one_of(
        st.fixed_dictionaries({}, optional={"effort": st.one_of(st.sampled_from(["low", "high"]), RJUNK),
                                            "summary": st.one_of(st.sampled_from(["auto", "long"]), RJUNK)}),
        RJUNK),
    "include": st.one_of(st.lists(st.one_of(st.sampled_from(
        ["reasoning.encrypted_content", "message.output_text.logprobs"]), RJUNK), max_size=2), RJUNK),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), RJUNK),
    "store": st.one_of(st.booleans(), RJUNK),
    "truncation": st.one_of(st.sampled_from(["disabled", "auto"]), RJUNK),
    "service_tier": st.one_of(st.sampled_from(["auto", "default", "flex"]), RJUNK),
    "top_logprobs": st.one_of(st.just(0), RJUNK),
    "max_tool_calls": RJUNK,
    "background": st.one_of(st.booleans(), RJUNK),
    "previous_response_id": st.one_of(st.none(), RJUNK),
    "conversation": RJUNK,
    "prompt": RJUNK,
    "prompt_cache_retention": st.one_of(st.sampled_from(["in-memory", "24h", "1y"]), RJUNK),
    "user": FIELDS["user"],
    "safety_identifier": FIELDS["user"],
    "prompt_cache_key": FIELDS["user"],
    "seed": FIELDS["seed"],
    "stop": FIELDS["stop"],
    "messages": RJUNK,  # the chat's: unknown here
    "max_tokens": RJUNK,
    "extra": RJUNK,
}

"""Property: for random JSON schemas, every generation at temperature 1 validates with the jsonschema library.

Schemas are drawn small (bounded strings, integers and arrays) so that a generation finishes within its token
budget; a truncated document could not validate, and would count as a failure.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUM_GENERATIONS = 20
MAX_TOKENS = 160

_LEAVES = st.one_of(
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span},
        st.integers(0, 3),
        st.integers(1, 6),
    ),
    st.builds(
        lambda values: {"enum": values},
        st.lists(st.sampled_from(["red", "green", "x y", "7"]), min_size=1, max_size=3, unique=True),
    ),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}[0-9]?$"}),
)


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": sorted(properties), "additionalProperties": False}


SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, inner, st.integers(0, 2)),
        st.dictionaries(st.sampled_from(["a", "b", "name", "id"]), inner, min_size=1, max_size=3).map(_object),
    ),
    max_leaves=4,
).map(lambda schema: _object({"value": schema}))


@pytest.mark.slow  # 80 generations of up to 160 tokens: minutes on 2 cores
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_every_generation_validates(server, schema):
    body = {
        "messages": [{"role": "user", "content": "Fill in the JSON."}],
        "n": NUM_GENERATIONS,
        "temperature": 1.0,
        "seed": 0,
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "value", "schema": schema}},
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=300)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == NUM_GENERATIONS
    for choice in choices:
        assert choice["finish_reason"] == "stop", (schema, choice["message"]["content"])
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)

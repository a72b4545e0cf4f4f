"""Structured output through `kimi-mlx cluster server` (issue 35): a pipeline of 3 stage
processes and a tensor group on loopback, the grammar applied on the head (the
pipeline's head chooser, the tensor group's rank 0). References: the `jsonschema`
validator and mlx-lm's `kimi_k3` tool parser (in the server's reply path)."""

import json

import jsonschema
import openai
import pytest

from kimi_mlx.testing.cluster import ServerProc
from kimi_mlx.testing.tensor_parallel import free_ports

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}},
    "required": ["color", "n", "tags"], "additionalProperties": False}
TOOL = {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module", params=["pipeline", "pipeline-ngram", "tensor"])
def server(request):
    """`cluster server` over the session's 3 pipeline stages (with `--draft ngram`: a
    constrained request decodes without the draft there), or a tensor group of this head
    and the session's tensor node's rank (tests/fixtures/shared.py; only read here)."""
    if request.param.startswith("pipeline"):
        cluster = request.getfixturevalue("micro_pipeline")
        extra = ("--draft", "ngram") if request.param.endswith("ngram") else ()
    else:
        cluster = request.getfixturevalue("tensor_node")
        extra = ("--parallel", "tensor", "--max-concurrency", "1")
    srv = ServerProc(cluster, free_ports(1)[0], *extra, timeout=240)
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=240, max_retries=0)
    finally:
        srv.stop()


def test_json_schema_and_forced_tool_through_the_cluster(server):
    for seed in (1, 2):
        r = server.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "Pick a colour."}],
            max_tokens=60, temperature=0.8, seed=seed, extra_body={"thinking_budget": 3},
            response_format={"type": "json_schema", "json_schema": {
                "name": "c", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = server.chat.completions.create(
        model="micro", messages=[{"role": "user", "content": "Add 2 and 3."}], max_tokens=80,
        temperature=0, tools=[{"type": "function", "function": TOOL}],
        tool_choice={"type": "function", "function": {"name": "add"}},
        extra_body={"thinking_budget": 3})
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls), r.choices[0]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), TOOL["parameters"])

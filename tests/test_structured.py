"""Structured output by constrained decoding (issue 35), on the shipped micro checkpoint
(a text model that has never seen JSON schemas or K3.1's tool-call markup), through the
real `openai` and `anthropic` clients. References: the `jsonschema` validator, mlx-lm's
own `generate_step` on the same weights and prompt, mlx-lm's `kimi_k3` tool parser (in
the server's reply path)."""

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import mlx.core as mx
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.servers import start_server, stop_server

MICRO = str(default_model())

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color", "shade"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3, "minItems": 1,
                                               "items": {"type": "string", "maxLength": 6}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "y": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "user"},
                                      "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Is it raining?", "Pick a colour.", "Tag this post.",
           "Where is the point?", "Make a user record.", "Answer yes or no.", "List numbers."]
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 16},
         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "add", "description": "Add two numbers",
     "parameters": {"type": "object", "properties": {
         "a": {"type": "integer", "minimum": 0, "maximum": 999},
         "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"],
         "additionalProperties": False}},
]
SCHEMA_OF = {t["name"]: t["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["batched", "one-process", "ngram-draft"])
def server(request):
    """The one-process server: batched (4 at once), one at a time (the session's cold
    reference server, tests/fixtures/shared.py: no prompt cache, read only here), and with
    `--draft ngram` (a constrained request decodes without the draft, as one with
    penalties)."""
    from kimi_mlx.speculative.settings import DraftSettings

    if request.param == "one-process":
        srv, svc = request.getfixturevalue("micro_cold_server")
        yield svc, srv
        return
    kw = {"batched": dict(max_concurrency=4),
          "ngram-draft": dict(max_concurrency=1, drafts=DraftSettings(kind="ngram"))}[request.param]
    srv, svc = start_server(MICRO, None, "micro", 1 << 20, **kw)
    yield svc, srv
    stop_server(srv, svc)


def _oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _json_reply(client, schema, prompt, enforce):
    kw = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True}}} if enforce else {}
    r = client.chat.completions.create(
        model="micro", messages=[{"role": "user", "content": prompt}], max_tokens=96,
        temperature=0.8, seed=7, extra_body={"thinking_budget": 6, "reasoning_effort": "low"}, **kw)
    text = r.choices[0].message.content or ""
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def test_json_schema_replies_validate(server):
    """Every enforced reply parses and validates with `jsonschema`; without enforcement
    (the same requests, the prompt only) micro gets (almost) none right."""
    svc, srv = server
    client = _oai(srv)
    cases = [(s, p) for s, p in zip(SCHEMAS, PROMPTS)]
    with ThreadPoolExecutor(4) as pool:
        enforced = list(pool.map(lambda c: _json_reply(client, *c, True), cases))
        free = list(pool.map(lambda c: _json_reply(client, *c, False), cases))
    print(f"valid: enforced {sum(enforced)}/{len(cases)}, without {sum(free)}/{len(cases)}")
    assert all(enforced), enforced
    assert sum(free) < len(cases)


def _check_call(name, args):
    assert name == "add"
    jsonschema.validate(args, SCHEMA_OF[name])


def test_forced_tool_chat_responses_anthropic(server):
    """A named tool through chat, responses and anthropic: a call to that tool whose
    arguments validate against its schema; `required` / `any` call one of the tools."""
    svc, srv = server
    client = _oai(srv)
    chat_tools = [{"type": "function", "function": t} for t in TOOLS]
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        r = client.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "What is 2 plus 3?"}],
            tools=chat_tools, tool_choice=choice, max_tokens=120, temperature=0,
            extra_body={"thinking_budget": 4})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
        for c in calls:
            name = c.function.name
            assert choice == "required" or name == "add"
            jsonschema.validate(json.loads(c.function.arguments), SCHEMA_OF[name])

    r = client.responses.create(
        model="micro", input="Add 4 and 5.", max_output_tokens=120, temperature=0,
        tools=[{"type": "function", **t} for t in TOOLS],
        tool_choice={"type": "function", "name": "add"}, extra_body={"thinking_budget": 4})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    for c in calls:
        _check_call(c.name, json.loads(c.arguments))

    a = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=120, max_retries=0)
    for choice, budget in (({"type": "tool", "name": "add"}, {"type": "disabled"}),
                           ({"type": "any"}, {"type": "enabled", "budget_tokens": 5})):
        m = a.messages.create(
            model="micro", max_tokens=120, messages=[{"role": "user", "content": "Add 1 and 2."}],
            tools=[{"name": t["name"], "description": t["description"],
                    "input_schema": t["parameters"]} for t in TOOLS],
            tool_choice=choice, thinking=budget)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses, m.content
        for u in uses:
            assert choice["type"] == "any" or u.name == "add"
            jsonschema.validate(u.input, SCHEMA_OF[u.name])


def test_unconstrained_greedy_unchanged(server):
    """Greedy tokens through the engine equal mlx-lm's own `generate_step` on the same
    weights and prompt: without any constraint, and with tools in auto mode (the grammar
    armed, waiting for a tools section micro never opens)."""
    from mlx_lm.generate import generate_step

    from kimi_mlx.generation.request import build_chat_prompt_with_ends
    from kimi_mlx.sampling import Sampling
    from kimi_mlx.server.jobs import Job, TokenOut
    from kimi_mlx.server.structured import constrained

    svc, srv = server
    msgs = [{"role": "user", "content": "Write a queue class."}]
    chat_tools = [{"type": "function", "function": t} for t in TOOLS]
    for tools in (None, chat_tools):
        ids, _ = build_chat_prompt_with_ends(svc.tok, msgs, "max", tools)
        ref = [int(t) for t, _ in generate_step(mx.array(ids), svc.engine.model, max_tokens=24)]
        sampling = constrained(svc, Sampling(), ids, tools=tools)
        assert (sampling.constraint is not None) == bool(tools)
        job = Job(list(ids), 24, sampling)
        job.attach(None)
        svc.engine.submit(job)
        got = [ev.token for ev in job.events() if isinstance(ev, TokenOut)]
        assert got == ref[:len(got)] and len(got) >= 8, (got, ref)


def test_bad_schema_is_a_400_naming_the_construct(server):
    svc, srv = server
    client = _oai(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                             "schema": {"type": "string", "format": "uri-template"}}})
    assert "uri-template" in str(e.value) and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad",
                             "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})
    assert "/nope" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            tools=[{"type": "function", "function": TOOLS[0]}],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "'nope'" in str(e.value) and e.value.body["param"] == "tool_choice"

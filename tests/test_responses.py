"""POST /v1/responses driven by the real `openai` client (`client.responses.create`, with and
without stream=True) on the shipped micro checkpoint. The references are independent of
the Responses adapter: the chat completions endpoint for the same conversation (its
greedy text), `encode_chat` for the prompt a tool round trip must produce, and the
event-by-event stream against the non-streamed response."""

import json

import httpx
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.responses_api import ResponseStore
from kimi_mlx.text.chat_format import encode_chat
from kimi_mlx.testing.servers import served, sibling_server

from fixtures.scripted import ScriptedEngine

KEY = "sk-responses"
MICRO = str(default_model())
SYSTEM, USER = "You are terse.", "Name a colour."


@pytest.fixture(scope="module")
def server():
    with served(MICRO, KEY) as both:
        yield both


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def streamed(client, **kw):
    """(events, reasoning deltas joined, text deltas joined, final response) of a
    stream=True request."""
    events = list(client.responses.create(stream=True, **kw))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events, reasoning, text, events[-1].response


def reasoning_of(r):
    return "".join(c.text for item in r.output if item.type == "reasoning" for c in item.content or [])


def check_plain(client, svc_tok=None):
    """Plain + streamed on one server: greedy text equals the chat endpoint's for the
    same conversation, and streamed deltas join to the non-streamed output."""
    kw = dict(model="micro", instructions=SYSTEM, input=USER, max_output_tokens=24,
              temperature=0, reasoning={"effort": "high"})
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 24
    chat = client.chat.completions.create(
        model="micro", max_tokens=24, temperature=0, reasoning_effort="high",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    m = chat.choices[0].message
    assert reasoning_of(r) == (m.reasoning_content or "") and r.output_text == (m.content or "")
    assert reasoning_of(r) + r.output_text  # the check compares something
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    if svc_tok is not None:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        assert r.usage.input_tokens == len(encode_chat(svc_tok, msgs, "high"))
    events, reasoning, text, final = streamed(client, **kw)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (reasoning, text) == (reasoning_of(r), r.output_text)
    assert (reasoning_of(final), final.output_text) == (reasoning_of(r), r.output_text)
    assert final.usage.output_tokens == 24
    assert types.count("response.output_item.added") == types.count("response.output_item.done")
    return r


def test_plain_and_streamed_equal_the_chat_endpoint(server, oai):
    r = check_plain(oai, server[1].tok)
    assert r.reasoning.effort == "high"
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_previous_response_id_continues_the_conversation(server, oai):
    _, svc = server
    first = oai.responses.create(model="micro", instructions=SYSTEM, input=USER,
                                 max_output_tokens=6, temperature=0)
    second = oai.responses.create(model="micro", instructions=SYSTEM, input="And another?",
                                  previous_response_id=first.id, max_output_tokens=3,
                                  temperature=0)
    reply = {"role": "assistant", "content": first.output_text,
             "reasoning_content": reasoning_of(first)}
    want = encode_chat(svc.tok, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": USER}, reply,
                                 {"role": "user", "content": "And another?"}])
    assert second.usage.input_tokens == len(want)
    assert second.previous_response_id == first.id
    # the held prefix (up to the end of the first user message) comes from the prompt cache
    assert 0 < second.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    # the same conversation sent whole gives the same prompt
    whole = oai.responses.create(model="micro", instructions=SYSTEM, max_output_tokens=1, input=[
        {"role": "user", "content": USER},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": reasoning_of(first)}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And another?"}]}])
    assert whole.usage.input_tokens == len(want)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="micro", input="x", previous_response_id="resp_nope")
    body = e.value.body
    assert body["param"] == "previous_response_id" and "resp_nope" in body["message"]
    # store=false is not kept
    kept = oai.responses.create(model="micro", input=USER, max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="micro", input="x", previous_response_id=kept.id)


def test_store_is_lru_bounded():
    s = ResponseStore(capacity=2)
    s.put("a", [1])
    s.put("b", [2])
    assert s.get("a") == [1]  # a is now the most recent
    s.put("c", [3])
    assert s.get("b") is None and s.get("a") == [1] and s.get("c") == [3] and len(s) == 2


@pytest.mark.parametrize("body,needle,param", [
    ({"model": "micro"}, "input", "input"),
    ({"model": "micro", "input": "x", "temperature": 3}, "[0, 2]", "temperature"),
    ({"model": "micro", "input": "x", "reasoning": {"effort": "ultra"}}, "medium, high, xhigh",
     "reasoning.effort"),
    ({"model": "micro", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"model": "micro", "input": "hello " * 5000}, "maximum context length", "input"),
    ({"model": "micro", "input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "input"),
    ({"model": "micro", "input": [{"type": "input_image", "image_url": "x"}]}, "input_image", "input"),
    ({"model": "micro", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input_image", "input"),
    ({"model": "micro", "input": [{"type": "function_call_output", "output": "x"}]}, "call_id", "input"),
    ({"model": "micro", "input": "x", "tools": [{"type": "custom", "name": "x"}]}, "tools[0]", "tools"),
    ({"model": "micro", "input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "custom", "name": "x"}]}]}, "tools[0].tools[0]", "tools"),
    ({"model": "micro", "input": "x", "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice", "tool_choice"),
    ({"model": "micro", "input": "x", "text": {"format": {"type": "grammar"}}}, "text.format",
     "text.format"),
    ({"model": "micro", "input": "x", "background": True}, "background", "background"),
    ({"model": "micro", "input": []}, "input is empty", "input"),
    ({"model": "micro", "input": "x", "top_logprobs": 2}, "top_logprobs", "top_logprobs"),
])
def test_400s_name_the_field(server, body, needle, param):
    for stream in (False, True):
        r = httpx.post(server[0].url + "/v1/responses", json={**body, "stream": stream},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error"
        assert err["param"] == param


def test_auth_and_unknown_model(server):
    url = server[0].url + "/v1/responses"
    r = httpx.post(url, json={"model": "micro", "input": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json={"model": "gpt-9", "input": "x"}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]


# ------------------------------------------------------------------ tools (scripted reply)


TOOL_REPLY = (
    "Let me look.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris é<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
)
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
               "parameters": TOOLS[0]["parameters"]}}]


@pytest.fixture(scope="module")
def scripted(server):
    _, real = server
    engine = ScriptedEngine(real.tok.encode(TOOL_REPLY, allow_special=True))
    srv = sibling_server(real, engine)
    yield srv, engine, real.tok
    srv.stop()


def test_function_tool_round_trip(scripted):
    srv, engine, tok = scripted
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
    r = c.responses.create(model="micro", input="Weather in Paris?", tools=TOOLS,
                           reasoning={"effort": "low"})
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert reasoning_of(r) == "Let me look." and r.output_text == "Checking."
    call = r.output[2]
    assert call.call_id == "functions.get_weather:1" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris é"}
    assert engine.prompts[-1] == encode_chat(
        tok, [{"role": "user", "content": "Weather in Paris?"}], "low", tools=CHAT_TOOLS)
    # streamed: the same items, the call's arguments as deltas
    events, reasoning, text, final = streamed(c, model="micro", input="Weather in Paris?",
                                              tools=TOOLS, reasoning={"effort": "low"})
    assert (reasoning, text) == ("Let me look.", "Checking.")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris é"} and events[-1].type == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].call_id == call.call_id
    # the client's stream helper accumulates the same response
    with c.responses.stream(model="micro", input="Weather in Paris?", tools=TOOLS,
                            reasoning={"effort": "low"}) as s:
        helper = s.get_final_response()
    assert helper.output_text == "Checking." and reasoning_of(helper) == "Let me look."
    assert json.loads(helper.output[2].arguments) == {"city": "Paris é"}
    # the result goes back: as the whole output + function_call_output, and by previous_response_id
    want = encode_chat(tok, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Let me look.",
         "tool_calls": [{"id": call.call_id, "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris é"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": call.call_id, "content": "sunny, 21C"},
    ], "low", tools=CHAT_TOOLS)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    c.responses.create(model="micro", tools=TOOLS, reasoning={"effort": "low"}, input=[
        {"role": "user", "content": "Weather in Paris?"},
        *[o.model_dump(exclude_none=True) for o in r.output], output])
    assert engine.prompts[-1] == want
    c.responses.create(model="micro", tools=TOOLS, reasoning={"effort": "low"},
                       previous_response_id=r.id, input=[output])
    assert engine.prompts[-1] == want

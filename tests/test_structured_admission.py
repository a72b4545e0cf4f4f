"""Schemas compiled (or refused) at admission, before any stream starts, on the shipped
micro checkpoint through the real `openai` and `anthropic` clients: what llguidance
refuses is a 400 naming `response_format` / `text.format` / `tools[i]` with no parser
state or grammar in it, streamed or not; a schema over --max-schema-bytes is refused
before compiling; one that compiles past --schema-timeout is refused at the time-out
(and at once when sent again). A neighbour's latency while the bombs are refused is
printed as a ratio to its latency alone (no timed assertion: the machine is shared).
References: llguidance's own verdict on the same schema alone, the HTTP status the
client library sees."""

import json
import statistics
import threading
import time

import anthropic
import openai
import pytest

from kimi_mlx.generation.constrain import SchemaLimits
from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.servers import start_server, stop_server

MICRO = str(default_model())
RECURSIVE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# the cycle only under a required property: found by compiling each $defs entry as a root
NESTED = {"$defs": RECURSIVE["$defs"], "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
          "required": ["x"]}
INTERNALS = ("<state>", "<grammar>", "%json", "Parser", "non-verbose", "start:")
EXTRA = {"thinking_budget": 2}


def _many_optional(n):
    """n optional string properties: llguidance's compile grows faster than the size."""
    return {"type": "object", "properties": {f"prop_{i}": {"type": "string"} for i in range(n)}}


@pytest.fixture(scope="module")
def server():
    srv, svc = start_server(MICRO, None, "micro", 16 << 20, max_concurrency=2)
    svc.schema_limits = SchemaLimits(max_bytes=256 << 10, timeout_s=1.0)
    yield srv, svc
    stop_server(srv, svc)


def _oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _no_internals(text):
    assert not any(k in text for k in INTERNALS), text


def test_llguidance_refuses_the_recursive_schemas_when_decoding_starts():
    """The reference: llguidance itself compiles both schemas but cannot start (or, nested,
    continue) a value: `NoExtensionBias` at the first mask of the cycle."""
    import llguidance

    from kimi_mlx.generation.constrain import grammar_tokenizer
    from kimi_mlx.text.tokenizer import KimiTokenizer

    ll = grammar_tokenizer(KimiTokenizer.from_pretrained(MICRO))
    m = llguidance.LLMatcher(ll, "start: %json " + json.dumps(RECURSIVE), log_level=0)
    assert not m.is_error()
    m.compute_bitmask()
    assert m.is_error() and "NoExtensionBias" in m.get_error()
    m = llguidance.LLMatcher(ll, "start: %json " + json.dumps(NESTED), log_level=0)
    m.compute_bitmask()
    assert not m.is_error()  # the nested cycle is met only at "x"'s value
    assert m.consume_tokens(ll.tokenize_str('{"x":'))
    m.compute_bitmask()
    assert m.is_error() and "NoExtensionBias" in m.get_error()


@pytest.mark.parametrize("schema", [RECURSIVE, NESTED], ids=["recursive", "nested"])
@pytest.mark.parametrize("stream", [False, True])
def test_recursive_schema_is_a_400_before_any_stream(server, schema, stream):
    srv, _ = server
    c = _oai(srv)
    with pytest.raises(openai.BadRequestError) as e:  # a 200 that then fails is an APIError
        r = c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=20, response_format=_rf(schema), stream=stream,
                                      extra_body=EXTRA)
        if stream:
            list(r)
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "no JSON value satisfies it" in e.value.message
    _no_internals(e.value.message)

    with pytest.raises(openai.BadRequestError) as e:
        r = c.responses.create(model="micro", input="x", max_output_tokens=20, stream=stream,
                               text={"format": {"type": "json_schema", "name": "s",
                                                "schema": schema}}, extra_body=EXTRA)
        if stream:
            list(r)
    assert e.value.body["param"] == "text.format" and "- text.format:" in e.value.message
    _no_internals(e.value.message)

    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as e:
        r = c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=20, tools=tools, tool_choice="required",
                                      stream=stream, extra_body=EXTRA)
        if stream:
            list(r)
    assert e.value.body["param"] == "tools[1]"
    _no_internals(e.value.message)

    a = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=120, max_retries=0)
    for choice in ({"type": "any"}, {"type": "tool", "name": "bad"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            kw = dict(model="micro", max_tokens=20, messages=[{"role": "user", "content": "x"}],
                      tools=[{"name": "ok", "input_schema": {"type": "object"}},
                             {"name": "bad", "input_schema": schema}], tool_choice=choice)
            if stream:
                with a.messages.stream(**kw) as s:
                    list(s)
            else:
                a.messages.create(**kw)
        assert e.value.status_code == 400 and "tools[1]" in str(e.value)
        _no_internals(str(e.value))


def test_a_good_schema_with_defs_still_works(server):
    """The per-definition check does not refuse a schema whose $defs are fine (a pydantic
    model's nested model, and a recursive list that can end)."""
    srv, _ = server
    schema = {"$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}},
                              "required": ["n"], "additionalProperties": False},
                        "L": {"type": "object", "properties": {"next": {"anyOf": [
                            {"$ref": "#/$defs/L"}, {"type": "null"}]}},
                              "required": ["next"], "additionalProperties": False}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "l": {"$ref": "#/$defs/L"}},
              "required": ["p"], "additionalProperties": False}
    r = _oai(srv).chat.completions.create(
        model="micro", messages=[{"role": "user", "content": "x"}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                "strict": True}}, extra_body=EXTRA)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["p"]["n"], int)


def _neighbour(c):
    t = time.perf_counter()
    c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "Hello"}],
                              max_tokens=16, temperature=0, extra_body={"reasoning_effort": "low"})
    return time.perf_counter() - t


def test_huge_and_slow_schemas_are_refused_without_costing_a_neighbour(server):
    srv, svc = server
    c = _oai(srv)
    _neighbour(c)
    alone = statistics.median(_neighbour(c) for _ in range(3))

    huge = _many_optional(150_000)  # ~5 MB
    assert len(json.dumps(huge)) > 5_000_000
    t = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=8, response_format=_rf(huge), extra_body=EXTRA)
    huge_s = time.perf_counter() - t
    assert e.value.body["param"] == "response_format" and "--max-schema-bytes" in e.value.message
    tools = [{"name": "f", "input_schema": {"type": "object"}}, {"name": "g", "input_schema": huge}]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=120, max_retries=0).messages.create(
            model="micro", max_tokens=8, messages=[{"role": "user", "content": "x"}],
            tools=tools, tool_choice={"type": "auto"})
    assert "tools[1]" in str(e.value) and "--max-schema-bytes" in str(e.value)

    slow = _many_optional(6000)  # ~200 KB, under the byte limit; seconds to compile
    assert len(json.dumps(slow)) < svc.schema_limits.max_bytes
    t = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=8, response_format=_rf(slow), extra_body=EXTRA)
    slow_s = time.perf_counter() - t
    assert e.value.body["param"] == "response_format" and "--schema-timeout" in e.value.message
    t = time.perf_counter()
    with pytest.raises(openai.BadRequestError):  # the same schema again: refused at once
        c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=8, response_format=_rf(slow), extra_body=EXTRA)
    again_s = time.perf_counter() - t

    # a neighbour's latency while bombs of one kind keep arriving (2 clients)
    errors, loaded = [], {}
    for kind in ("slow", "huge"):
        stop = threading.Event()

        def bomb(i):
            n = 6000 + 1000 * i
            while not stop.is_set():
                schema = huge if kind == "huge" else _many_optional(n)  # a new slow one each time
                n += 2
                try:
                    c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=8, response_format=_rf(schema), extra_body=EXTRA)
                    errors.append("accepted")
                except openai.BadRequestError:
                    pass
                except openai.APIStatusError as err:  # 503 while the compile threads are busy
                    if err.status_code != 503:
                        errors.append(repr(err))

        threads = [threading.Thread(target=bomb, args=(i,), daemon=True) for i in range(2)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        loaded[kind] = statistics.median(_neighbour(c) for _ in range(3))
        stop.set()
        for th in threads:
            th.join(60)
    print(f"\nhuge (5 MB) refused in {huge_s:.2f} s; slow (200 KB) refused in {slow_s:.2f} s "
          f"(time-out {svc.schema_limits.timeout_s} s), again in {again_s:.3f} s; neighbour "
          f"{alone:.3f} s alone; under slow-schema bombs {loaded['slow']:.3f} s (ratio "
          f"{loaded['slow'] / alone:.2f}), under 5 MB bombs {loaded['huge']:.3f} s (ratio "
          f"{loaded['huge'] / alone:.2f})")
    assert not errors, errors
    # the compile threads come free again once the abandoned compiles end: a good schema
    # is served again (a 503 meanwhile, never a wrong answer)
    deadline = time.monotonic() + 180
    while True:
        try:
            r = c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=60, response_format={"type": "json_object"},
                                          extra_body=EXTRA)
            break
        except openai.APIStatusError as err:
            assert err.status_code == 503 and time.monotonic() < deadline, err
            time.sleep(1)
    assert r.choices[0].finish_reason == "stop"


def test_end_of_message_is_forced_once_the_grammar_completes():
    """Model-free: after `<|close|>message<|sep|>` the processor allows `<|end_of_msg|>`
    alone (the chat format's end of turn, `text.chat_format`), for a JSON reply and a
    forced call; before it, the message's close is what the grammar allows."""
    import numpy as np

    from kimi_mlx.generation.constrain import build_constraint
    from kimi_mlx.text.chat_format import END_OF_MSG, THINK_START
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(MICRO)
    prompt = tok.encode(THINK_START, allow_special=True)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [({"response_format": {"type": "json_object"}},
              '<|open|>response<|sep|>{}<|close|>response<|sep|>'),
             ({"tools": [tool], "tool_choice": "required"},
              '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>json type="object"'
              '<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')]
    for kw, body in cases:
        p = build_constraint(tok, prompt, **kw).processor()
        for t in tok.encode("<|close|>think<|sep|>" + body + "<|close|>message<|sep|>",
                            allow_special=True):
            ok = p.allowed()
            assert ok is None or ok[t], (kw, t)
            p.feed(t)
        ok = p.allowed()
        assert np.flatnonzero(ok).tolist() == [tok.special_tokens[END_OF_MSG]], kw

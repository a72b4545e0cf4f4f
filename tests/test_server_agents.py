"""What coding agents and their SDKs send and parse (issue 32), driven with the real
`openai` and `anthropic` clients and httpx against `kimi-mlx server` on the shipped micro
checkpoint: Claude Code's mid-conversation system message and billing header, Codex's
namespace and hosted tools, effort names, context errors in the dialects' own wording,
stop strings outside the reasoning, named tool_choice, reasoning summaries, signs of life
during a long prefill, HEAD /, 401 texts, /tokenize and a context past the trained one.

References: prompts are checked against `chat_format.encode_chat` of the messages the
API defines (Moonshot's reference layout, tested on its own in test_chat_format.py);
error texts against the strings the clients match (Claude Code's retry pattern, the
OpenAI code field); replies of a scripted engine against the script."""

import json
import logging
import re
import threading
import time

import anthropic
import httpx
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.app import create_app
from kimi_mlx.server.engine_base import BaseEngine
from kimi_mlx.server.jobs import Finished, Started, TokenOut
from kimi_mlx.server.serving import BackgroundServer, make_service
from kimi_mlx.testing.servers import served
from kimi_mlx.text.chat_format import encode_chat

KEY = "sk-agents-key"
MICRO = str(default_model())
CONTEXT = 4400  # past micro's trained 4096 (item 9)
MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server():
    with served(MICRO, KEY, None, max_concurrency=2, prompt_cache_bytes=256 << 20,
                max_kv_size=CONTEXT) as both:
        yield both


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server[0].url, api_key=KEY, timeout=120, max_retries=0)


class _Scripted(BaseEngine):
    """An engine answering every job with fixed token ids, after `delay` seconds (a
    long prefill stand-in)."""

    def __init__(self, tokens, delay: float = 0.0):
        super().__init__()
        self.tokens, self.delay = tokens, delay

    def submit(self, job):
        def run():
            job.emit(Started(0))
            time.sleep(self.delay)
            for t in self.tokens[: job.max_tokens]:
                job.emit(TokenOut(t))
            reason = "stop" if len(self.tokens) <= job.max_tokens else "length"
            job.emit(Finished(reason, len(job.ids), 0, min(len(self.tokens), job.max_tokens)))
        threading.Thread(target=run, daemon=True).start()
        return job


def _sibling(real, engine=None, context=None):
    """Another app over `real`'s tokenizer, answering through `engine` (default the real
    one) with its own context; returns (BackgroundServer, Service)."""
    svc = make_service(MICRO, None, "micro", 1 << 20)
    svc.wrapper, svc.tok, svc.vocab_size = real.wrapper, real.tok, real.vocab_size
    svc.context = context or real.context
    svc.engine = engine or real.engine
    return BackgroundServer(create_app(svc)).start(), svc


def _scripted_server(real, reply: str, delay: float = 0.0):
    return _sibling(real, _Scripted(real.tok.encode(reply, allow_special=True), delay))


# ------------------------------------------------------------ the first-request failures


def test_claude_code_mid_conversation_system_message(server, ant):
    """Claude Code (beta mid-conversation-system-2026-04-07) puts a system message inside
    `messages`: accepted, and encoded as the reference renders a system message there."""
    _, svc = server
    r = ant.messages.create(
        model="micro", max_tokens=1, system="You are Claude Code.",
        extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"},
        messages=[{"role": "user", "content": "hi"},
                  {"role": "system", "content": [{"type": "text", "text": "Agents: explore."}]},
                  {"role": "user", "content": "go"}])
    want = encode_chat(svc.tok, [{"role": "system", "content": "You are Claude Code."},
                                 {"role": "user", "content": "hi"},
                                 {"role": "system", "content": "Agents: explore."},
                                 {"role": "user", "content": "go"}])
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(want)


def test_codex_namespace_tools_are_unwrapped_and_hosted_tools_dropped(server, oai, caplog):
    """Codex wraps function tools in a `namespace` tool and adds the hosted web_search:
    the namespace's functions reach the prompt as plain tools, web_search is left out
    with a log line."""
    _, svc = server
    fn = TOOL["function"]
    with caplog.at_level(logging.INFO, logger="kimi_mlx.server"):
        r = oai.responses.create(model="micro", input="weather?", max_output_tokens=1, tools=[
            {"type": "namespace", "name": "weather", "description": "Weather tools.",
             "tools": [{"type": "function", **fn}]},
            {"type": "web_search"}])
    want = encode_chat(svc.tok, [{"role": "user", "content": "weather?"}], tools=[TOOL])
    assert r.usage.input_tokens == len(want)
    assert any("web_search" in m and "dropped" in m for m in caplog.messages)


def test_namespace_calls_name_their_namespace(server):
    """A call of a namespace's function comes back naming the namespace (as OpenAI's
    function_call items do), streamed and not."""
    real = server[1]
    srv, _ = _scripted_server(real, '<|close|>think<|sep|><|open|>tools<|sep|><|open|>call '
                              'tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
                              'type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|>'
                              '<|close|>tools<|sep|>')
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        kw = dict(model="micro", input="weather?", tools=[
            {"type": "namespace", "name": "weather", "tools": [{"type": "function", **TOOL["function"]}]}])
        call = [o for o in c.responses.create(**kw).output if o.type == "function_call"][0]
        assert (call.name, call.namespace, json.loads(call.arguments)) == ("get_weather", "weather",
                                                                          {"city": "Oslo"})
        done = [e for e in c.responses.create(stream=True, **kw) if e.type == "response.completed"]
        call = [o for o in done[0].response.output if o.type == "function_call"][0]
        assert call.namespace == "weather"
    finally:
        srv.stop()


# ------------------------------------------------------------ numbered items


def test_1_effort_names_map_onto_k31_efforts(server, oai, ant):
    """Every OpenAI effort name is accepted on chat and Responses (and Anthropic's
    output_config.effort), each encoded as the K3.1 effort the README's table names."""
    _, svc = server
    table = {"none": "low", "minimal": "low", "low": "low", "medium": "high", "high": "high",
             "xhigh": "max", "max": "max"}
    for name, k31 in table.items():
        want = len(encode_chat(svc.tok, MSGS, k31))
        r = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=1,
                                        reasoning_effort=name)
        assert r.usage.prompt_tokens == want, name
        r = oai.responses.create(model="micro", input=MSGS[1:], instructions=MSGS[0]["content"],
                                 max_output_tokens=1, reasoning={"effort": name})
        assert r.usage.input_tokens == want, name
    # the three K3.1 efforts give three different prompts: the mapping is not a no-op
    assert len({tuple(encode_chat(svc.tok, MSGS, e)) for e in set(table.values())}) == 3
    r = ant.messages.create(model="micro", max_tokens=1, system=MSGS[0]["content"],
                            messages=MSGS[1:], extra_body={"output_config": {"effort": "medium"}})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(encode_chat(svc.tok, MSGS, "high"))
    with pytest.raises(openai.BadRequestError, match="xhigh"):
        oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=1,
                                    reasoning_effort="ultra")


def test_3_stop_strings_match_in_the_answer_not_the_reasoning(server):
    """A "\\n\\n" stop meant for the answer does not end the reply while the model thinks
    (chat stop, Anthropic stop_sequences; streamed and not)."""
    real = server[1]
    srv, _ = _scripted_server(real, "Step one.\n\nStep two.<|close|>think<|sep|><|open|>response"
                              "<|sep|>Red.\n\nAlso blue.<|close|>response<|sep|>")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        kw = dict(model="micro", messages=MSGS, max_tokens=100, stop=["\n\n"])
        ch = c.chat.completions.create(**kw).choices[0]
        assert (ch.message.reasoning_content, ch.message.content, ch.finish_reason) == (
            "Step one.\n\nStep two.", "Red.", "stop")
        chunks = list(c.chat.completions.create(stream=True, **kw))
        assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == "Red."
        a = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=60, max_retries=0)
        m = a.messages.create(model="micro", max_tokens=100, messages=MSGS[1:],
                              stop_sequences=["\n\n"])
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == ("Step one.\n\nStep two.", "Red.")
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "\n\n")
    finally:
        srv.stop()


def test_4_context_errors_in_the_wording_clients_parse(server, oai, ant):
    _, svc = server
    long = "hello " * (CONTEXT + 200)
    # Anthropic: the prompt alone too long, and prompt + max_tokens past the context
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="micro", max_tokens=1, messages=[{"role": "user", "content": long}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    m = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", e.value.body["error"]["message"])
    assert m and int(m.group(1)) == len(encode_chat(svc.tok, [{"role": "user", "content": long}]))
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model="micro", max_tokens=CONTEXT, messages=MSGS[1:])
    # the pattern Claude Code retries on with a smaller max_tokens
    m = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)",
                  e.value.body["error"]["message"])
    n = len(encode_chat(svc.tok, MSGS[1:]))
    assert m and tuple(map(int, m.groups())) == (n, CONTEXT, CONTEXT)
    # OpenAI: code context_length_exceeded, param messages / input / prompt
    for call, param in [(lambda: oai.chat.completions.create(
                            model="micro", max_tokens=1, messages=[{"role": "user", "content": long}]),
                         "messages"),
                        (lambda: oai.responses.create(model="micro", input=long, max_output_tokens=1),
                         "input"),
                        (lambda: oai.completions.create(model="micro", prompt=long, max_tokens=1),
                         "prompt")]:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert (e.value.code, e.value.param) == ("context_length_exceeded", param)
        assert "maximum context length" in e.value.message


def test_4_openai_replies_are_cut_at_the_context(server):
    """prompt + max_tokens past the context, the prompt inside it: the OpenAI endpoints
    answer up to the context with finish_reason length (Responses: incomplete,
    max_output_tokens), not a 400."""
    real = server[1]
    n = len(encode_chat(real.tok, MSGS))
    srv, svc = _sibling(real, context=n + 3)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        r = c.chat.completions.create(model="micro", messages=MSGS, max_tokens=8000)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
        chunks = list(c.chat.completions.create(model="micro", messages=MSGS, max_tokens=8000,
                                                stream=True))
        assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "length"
        r = c.responses.create(model="micro", input=MSGS[1:], instructions=MSGS[0]["content"],
                               max_output_tokens=8000)
        assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == (
            "incomplete", "max_output_tokens", 3)
        p = len(real.tok.encode("Once upon a time"))
        svc.context = p + 2
        r = c.completions.create(model="micro", prompt="Once upon a time", max_tokens=8000)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 2)
    finally:
        srv.stop()


def test_server_max_tokens_caps_a_request_that_sets_none(server):
    """`kimi-mlx server --max-tokens N` (Codex 0.171 sends no max_output_tokens): a request
    without a budget gets N tokens (finish length, Responses incomplete); one that sets
    its own keeps it."""
    real = server[1]
    srv, svc = _sibling(real, context=real.context)
    svc.default_max_tokens = 3
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        r = c.chat.completions.create(model="micro", messages=MSGS, temperature=0)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
        r = c.responses.create(model="micro", input=MSGS[1:], temperature=0)
        assert (r.status, r.usage.output_tokens) == ("incomplete", 3)
        # greedy: the same first 3 tokens, so its own budget shows as more than 3
        r = c.chat.completions.create(model="micro", messages=MSGS, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens > 3, r.usage
    finally:
        srv.stop()


def test_5_named_tool_choice_in_every_form(server, oai, ant):
    """A named tool_choice (chat, Responses, Anthropic `tool`, and `any`) is accepted and
    reaches the prompt as Moonshot's reference encoder passes it: a name renders no block
    (as auto), `any` the required block; a name that is not a tool is a 400 naming it."""
    _, svc = server
    auto = len(encode_chat(svc.tok, MSGS, tools=[TOOL]))
    r = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=1, tools=[TOOL],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.usage.prompt_tokens == auto
    r = oai.responses.create(model="micro", input=MSGS[1:], instructions=MSGS[0]["content"],
                             max_output_tokens=1, tools=[{"type": "function", **TOOL["function"]}],
                             tool_choice={"type": "function", "name": "get_weather"})
    assert r.usage.input_tokens == auto
    atool = {"name": "get_weather", "description": "Weather.",
             "input_schema": TOOL["function"]["parameters"]}
    r = ant.messages.create(model="micro", max_tokens=1, system=MSGS[0]["content"], messages=MSGS[1:],
                            tools=[atool], tool_choice={"type": "tool", "name": "get_weather"})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == auto
    r = ant.messages.create(model="micro", max_tokens=1, system=MSGS[0]["content"], messages=MSGS[1:],
                            tools=[atool], tool_choice={"type": "any"})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(
        encode_chat(svc.tok, MSGS, tools=[TOOL], tool_choice="required"))
    with pytest.raises(openai.BadRequestError, match="'nope'") as e:
        oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=1, tools=[TOOL],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="'nope'"):
        oai.responses.create(model="micro", input="x", tools=[{"type": "function", **TOOL["function"]}],
                             tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="'nope'"):
        ant.messages.create(model="micro", max_tokens=1, messages=MSGS[1:], tools=[atool],
                            tool_choice={"type": "tool", "name": "nope"})


def test_6_reasoning_summary_is_the_reasoning_text(server, oai):
    """reasoning.summary: the reasoning item's summary is its reasoning text, and the
    stream carries it as reasoning_summary_text deltas (what Codex shows)."""
    kw = dict(model="micro", input="Name a colour.", max_output_tokens=6, temperature=0,
              reasoning={"effort": "low", "summary": "auto"})
    r = oai.responses.create(**kw)
    item = [o for o in r.output if o.type == "reasoning"][0]
    assert item.summary[0].type == "summary_text" and item.summary[0].text == item.content[0].text
    assert item.summary[0].text  # micro stays in its think channel: all 6 tokens are reasoning
    events = list(oai.responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert deltas == item.summary[0].text
    assert [e.type for e in events].count("response.reasoning_summary_part.added") == 1
    done = [e for e in events if e.type == "response.reasoning_summary_text.done"]
    assert done and done[0].text == deltas
    # without summary: none, as before
    r = oai.responses.create(**{**kw, "reasoning": {"effort": "low"}})
    assert [o for o in r.output if o.type == "reasoning"][0].summary == []


def test_7_billing_header_is_out_of_the_prompt_and_the_cache_hits(server, ant):
    """Claude Code's first system block `x-anthropic-billing-header: ...` changes per
    version / request: it is normalised out, so the next request reads the prompt cache."""
    _, svc = server
    body = "You are an interactive CLI tool that helps users with software engineering tasks. " * 8

    def ask(billing):
        return ant.messages.create(model="micro", max_tokens=1, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{billing}; "
                                     f"cc_entrypoint=cli; cch={billing}abc;"},
            {"type": "text", "text": body, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "List the files."}])

    first, second = ask(7), ask(8)
    want = len(encode_chat(svc.tok, [{"role": "system", "content": body},
                                     {"role": "user", "content": "List the files."}]))
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == want
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == want
    assert second.usage.cache_read_input_tokens > 0


def test_8_streams_show_life_during_a_long_prefill(server):
    """OpenAI streams send something at once and SSE comments while the prompt is read;
    the clients still parse them; a non-streamed request outlives uvicorn's only timer
    (keep-alive, 5 s) without being cut."""
    real = server[1]
    srv, svc = _scripted_server(real, "Hm.<|close|>think<|sep|><|open|>response<|sep|>Red."
                                "<|close|>response<|sep|>", delay=1.2)
    svc.keepalive_s = 0.25
    try:
        for path, body in [("/v1/chat/completions", {"messages": MSGS}),
                           ("/v1/completions", {"prompt": "Once"}),
                           ("/v1/responses", {"input": "Name a colour."})]:
            t0 = time.monotonic()
            first, pings_before_data = None, 0
            with httpx.stream("POST", srv.url + path, json={"model": "micro", "stream": True, **body},
                              timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if first is None:
                        first = time.monotonic() - t0
                    if line == ": ping":
                        pings_before_data += 1
                    if '"Red.' in line or '"Hm.' in line:
                        break
            assert first < 0.8, (path, first)  # before the 1.2 s "prefill" ends
            assert pings_before_data >= 3, path
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        chunks = list(c.chat.completions.create(model="micro", messages=MSGS, stream=True))
        assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == "Red."
        svc.engine.delay = 6.0
        r = c.chat.completions.create(model="micro", messages=MSGS)
        assert r.choices[0].message.content == "Red."
    finally:
        srv.stop()


def test_9_max_kv_size_past_the_trained_context(server, oai, caplog):
    """--max-kv-size past the checkpoint's max_position_embeddings (micro: 4096) serves
    that context, with one warning naming both, and a prompt longer than 4096 runs."""
    from kimi_mlx.generation.request import serving_context

    _, svc = server
    assert svc.context == CONTEXT
    assert oai.models.list().data[0].context_length == CONTEXT
    with caplog.at_level(logging.WARNING, logger="kimi_mlx"):
        assert serving_context(4096, 9000) == (9000, "--max-kv-size")
        assert serving_context(4096, 1000) == (1000, "--max-kv-size")
        assert serving_context(4096, None)[0] == 4096
    warned = [m for m in caplog.messages if "4096" in m]
    assert len(warned) == 1 and "9000" in warned[0]
    text = "hello world " * 840
    n = len(encode_chat(svc.tok, [{"role": "user", "content": text}]))
    assert 4096 < n < CONTEXT
    r = oai.chat.completions.create(model="micro", max_tokens=1, messages=[{"role": "user", "content": text}])
    assert r.usage.prompt_tokens == n and r.choices[0].finish_reason == "length"


def test_10_head_401_texts_and_tokenize(server):
    srv, svc = server
    url = srv.url
    assert httpx.head(url + "/").status_code == 200
    # 401s in each dialect's own words, through its own client
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model="micro", max_tokens=1, messages=MSGS[1:])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid x-api-key"}}
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong-key-123", max_retries=0).models.list()
    assert e.value.code == "invalid_api_key"
    assert e.value.body["message"].startswith("Incorrect API key provided")
    assert "sk-wrong-key-123" not in e.value.message  # echoed masked only
    # llama-server's /tokenize and /detokenize
    h = {"Authorization": f"Bearer {KEY}"}
    text = "Hello <|open|> wörld"
    r = httpx.post(url + "/tokenize", json={"content": text}, headers=h)
    assert r.status_code == 200 and r.json() == {"tokens": svc.tok.encode(text, allow_special=True)}
    assert svc.tok.special_tokens["<|open|>"] in r.json()["tokens"]  # parse_special defaults true
    r = httpx.post(url + "/tokenize", json={"content": text, "parse_special": False,
                                            "add_special": True, "with_pieces": True}, headers=h)
    pieces = r.json()["tokens"]
    assert [p["id"] for p in pieces] == svc.tok.encode(text)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == text.encode()
    r = httpx.post(url + "/detokenize", json={"tokens": svc.tok.encode(text)}, headers=h)
    assert r.json() == {"content": text}
    r = httpx.post(url + "/detokenize", json={"tokens": [10 ** 9]}, headers=h)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"content": "x"}).status_code == 401

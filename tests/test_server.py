"""`kimi-mlx server` driven by the real `openai` and `anthropic` clients (and curl) on the
shipped micro checkpoint. The micro model is not chat-tuned: these tests check structure
and equality between paths (streamed vs not, server vs an independent greedy loop, cache
hit vs cold), not answer quality."""

import json
import shutil
import subprocess
import threading
import time

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest

from kimi_mlx.server.engine_base import BaseEngine
from kimi_mlx.text.chat_format import encode_chat
from kimi_mlx.server.app import create_app
from kimi_mlx.server.serving import BackgroundServer, load_service, make_service, resolve_api_key
from kimi_mlx.server.jobs import TokenOut
from kimi_mlx.generation.request import InputError, default_model
from kimi_mlx.testing.servers import served, sibling_server

from fixtures.scripted import TOOL_REPLY, ScriptedEngine

KEY = "sk-test-key"
MICRO = str(default_model())


@pytest.fixture(scope="module")
def server():
    with served(MICRO, KEY, None, max_concurrency=4, prompt_cache_bytes=256 << 20,
                max_queue=16) as both:
        yield both


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server[0].url, api_key=KEY, timeout=120, max_retries=0)


def greedy_reference(model, ids, n):
    """n greedy tokens and their logprobs, recomputing the whole sequence each step (no
    cache, no mlx-lm): an independent reference for the server's cached generation."""
    out, lps = list(ids), []
    for _ in range(n):
        logits = model(mx.array(out)[None])[0, -1].astype(mx.float32)
        t = int(mx.argmax(logits).item())
        lps.append((logits[t] - mx.logsumexp(logits)).item())
        out.append(t)
    return out[len(ids):], lps


MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


def test_chat_greedy_tokens_and_logprobs_match_independent_loop(server, oai):
    _, svc = server
    r = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.finish_reason == "length"
    ids = encode_chat(svc.tok, MSGS)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    assert r.usage.total_tokens == len(ids) + 8
    ref, ref_lp = greedy_reference(svc.engine.model, ids, 8)
    assert [bytes(e.bytes) for e in ch.logprobs.content] == [svc.tok.decode_bytes([t]) for t in ref]
    for e, lp in zip(ch.logprobs.content, ref_lp):
        assert e.logprob == pytest.approx(lp, abs=1e-3)  # float32, cached vs recomputed
        tops = [a.logprob for a in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(e.logprob)
    # the micro model stays in its think channel: all the text is reasoning
    assert ch.message.reasoning_content == svc.tok.decode(ref)
    assert ch.message.content == ""
    assert r.usage.completion_tokens_details.reasoning_tokens == 8


def _stream_chat(oai, **kw):
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, reasoning, content, finish


def test_streamed_equals_non_streamed_for_the_same_seed(oai):
    kw = dict(model="micro", messages=MSGS, max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    r = oai.chat.completions.create(**kw)
    chunks, reasoning, content, finish = _stream_chat(oai, **kw)
    assert reasoning == r.choices[0].message.reasoning_content
    assert content == r.choices[0].message.content
    assert finish == [r.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens
    # a different seed samples something else (the seed is honoured, not ignored)
    other = oai.chat.completions.create(**{**kw, "seed": 8})
    assert other.choices[0].message.reasoning_content != r.choices[0].message.reasoning_content


def test_completions_raw_prompt_and_stop_string_across_tokens(server, oai):
    _, svc = server
    r = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=16, temperature=0)
    ids = svc.tok.encode("Once upon a time")
    ref, _ = greedy_reference(svc.engine.model, ids, 16)
    assert r.choices[0].text == svc.tok.decode(ref) and r.choices[0].finish_reason == "length"
    # a stop string that starts inside token 3 and ends inside token 5
    pieces = [svc.tok.decode([t]) for t in ref]
    before = "".join(pieces[:3])
    stop = pieces[2][-1:] + pieces[3] + pieces[4][:1]
    assert len(pieces[2]) >= 1 and len(pieces[4]) >= 1
    want = r.choices[0].text[: r.choices[0].text.find(stop)]
    assert want == before[:-1]
    s = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=16,
                               temperature=0, stop=["zzzz-never", stop])
    assert s.choices[0].text == want and s.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model="micro", prompt="Once upon a time", max_tokens=16, temperature=0, stop=stop,
        stream=True) if c.choices)
    assert streamed == want


def _blocks(message):
    keep = ("type", "text", "thinking", "id", "name", "input")
    return [{k: v for k, v in b.model_dump().items() if k in keep} for b in message.content]


def test_anthropic_messages_plain_and_streamed(ant, oai):
    kw = dict(model="micro", max_tokens=10, system="You are terse.",
              messages=[{"role": "user", "content": "Name a colour."}],
              extra_body={"temperature": 0})
    m = ant.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 10
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=10, temperature=0)
    assert thinking == o.choices[0].message.reasoning_content
    with ant.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_delta" in events
    assert _blocks(final) == _blocks(m) and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    n = ant.messages.count_tokens(model="micro", system="You are terse.",
                                  messages=[{"role": "user", "content": "Name a colour."}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_reasoning_and_tool_history_are_encoded(server, oai):
    _, svc = server
    base = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "functions.get_weather:1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = base + [
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "sunny, 21C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = oai.chat.completions.create(model="micro", messages=turns, tools=tools, max_tokens=1,
                                    temperature=0)
    want = encode_chat(svc.tok, [*base, {**turns[1], "tool_calls": [call]},
                                 {"role": "tool", "name": "get_weather", "content": "sunny, 21C"}],
                       tools=tools)
    assert r.usage.prompt_tokens == len(want)
    # without the reasoning the prompt is shorter: preserved thinking was encoded
    no_think = [turns[0], {k: v for k, v in turns[1].items() if k != "reasoning_content"}, turns[2]]
    r2 = oai.chat.completions.create(model="micro", messages=no_think, tools=tools, max_tokens=1)
    assert r2.usage.prompt_tokens < r.usage.prompt_tokens


def test_prompt_cache_hit_gives_cold_greedy_tokens(server, oai):
    _, svc = server
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    first = [system, {"role": "user", "content": "First question?"}]
    a = oai.chat.completions.create(model="micro", messages=first, max_tokens=6, temperature=0)
    second = [system, {"role": "user", "content": "A different question!"}]
    b = oai.chat.completions.create(model="micro", messages=second, max_tokens=6, temperature=0,
                                    logprobs=True)
    sys_len = len(encode_chat(svc.tok, [system], add_generation_prompt=False))
    assert b.usage.prompt_tokens_details.cached_tokens == sys_len
    ids = encode_chat(svc.tok, second)
    ref, _ = greedy_reference(svc.engine.model, ids, 6)
    assert [bytes(e.bytes) for e in b.choices[0].logprobs.content] == [svc.tok.decode_bytes([t]) for t in ref]
    # an exact repeat hits at the end of the last message and still runs the generation prompt
    c = oai.chat.completions.create(model="micro", messages=second, max_tokens=6, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens == len(
        encode_chat(svc.tok, second, add_generation_prompt=False))
    assert c.choices[0].message.reasoning_content == b.choices[0].message.reasoning_content
    assert a.usage.prompt_tokens_details.cached_tokens < sys_len  # at most the effort block


# ------------------------------------------------------------------ tool calls (scripted)


@pytest.fixture(scope="module")
def scripted(server):
    _, real = server
    srv = sibling_server(real, ScriptedEngine(real.tok.encode(TOOL_REPLY, allow_special=True)))
    yield srv
    srv.stop()


def test_tool_calls_openai_streamed_and_not(scripted):
    c = openai.OpenAI(base_url=scripted.url + "/v1", api_key="x", timeout=60, max_retries=0)
    kw = dict(model="micro", messages=[{"role": "user", "content": "Weather?"}], max_tokens=200)
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert (m.reasoning_content, m.content) == ("Let me look.", "Checking.")
    (call,) = m.tool_calls
    assert call.id == "functions.get_weather:1" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris é", "days": 3}
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == call.id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2  # name first, then argument fragments
    joined = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(joined) == json.loads(call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_tool_calls_anthropic_streamed_and_not(scripted):
    c = anthropic.Anthropic(base_url=scripted.url, api_key="x", timeout=60, max_retries=0)
    kw = dict(model="micro", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
              tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    tu = m.content[2]
    assert tu.id == "functions.get_weather:1" and tu.input == {"city": "Paris é", "days": 3}
    assert m.stop_reason == "tool_use"
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert _blocks(final) == _blocks(m) and final.stop_reason == "tool_use"
    # round trip: the tool_use id comes back as tool_result and is accepted
    back = c.messages.create(model="micro", max_tokens=5, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "sunny"}]},
    ])
    assert back.type == "message"


# ------------------------------------------------------------------ errors


def _post(url, path, body, key=KEY, raw=None, headers=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    if raw is not None:
        return httpx.post(url + path, content=raw, headers={**h, "Content-Type": "application/json"}, timeout=60)
    return httpx.post(url + path, json=body, headers=h, timeout=60)


@pytest.mark.parametrize("body,needle", [
    (None, "not valid JSON"),
    ({"model": "micro"}, "messages"),
    ({"model": "micro", "messages": MSGS, "temperature": -1}, "temperature"),
    ({"model": "micro", "messages": MSGS, "reasoning_effort": "ultra"}, "medium, high, xhigh, max"),
    ({"model": "micro", "messages": MSGS, "n": 2}, "n=2"),
    ({"model": "micro", "messages": MSGS, "response_format": {"type": "grammar"}}, "response_format"),
    ({"model": "micro", "messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    # a prompt past the context (prompt + max_tokens past it is cut at the context instead:
    # test_server_agents.py)
    ({"model": "micro", "messages": [{"role": "user", "content": "hello " * 5000}]}, "4096"),
    ({"model": "micro", "messages": [{"role": "user", "content": "hello " * 5000}], "stream": True},
     "maximum context length"),
    ({"model": "micro", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
])
def test_openai_400s(server, body, needle):
    r = _post(server[0].url, "/v1/chat/completions", body, raw=b"{not json" if body is None else None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_context_error_names_both_numbers(server):
    # (Anthropic's dialect: OpenAI's cuts the reply at the context instead)
    r = _post(server[0].url, "/v1/messages", {"model": "micro", "messages": MSGS[1:],
                                             "max_tokens": 5000, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "4096" in r.json()["error"]["message"] and "5000" in r.json()["error"]["message"]


def test_auth_404_413_and_anthropic_shape(server):
    url = server[0].url
    r = _post(url, "/v1/chat/completions", {"model": "micro", "messages": MSGS}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _post(url, "/v1/chat/completions", {"model": "micro", "messages": MSGS}, key="sk-wrong")
    assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
    r = _post(url, "/v1/chat/completions", {"model": "gpt-9", "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    r = _post(url, "/v1/chat/completions", {"model": "micro", "messages": [
        {"role": "user", "content": "x" * (80 << 10)}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = _post(url, "/v1/messages", {"model": "micro", "messages": MSGS[1:]}, key=None,
              headers={"x-api-key": KEY})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    r = _post(url, "/v1/messages", {"model": "micro", "max_tokens": 2, "messages": MSGS[1:]},
              key=None, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _post(url, "/v1/messages", {"model": "nope", "max_tokens": 2, "messages": MSGS[1:]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def test_health_models_metrics_and_loading_503(server, oai):
    srv, svc = server
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    assert [m.id for m in oai.models.list()] == ["micro"]
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("kimi_mlx_requests_total", "kimi_mlx_generation_tokens_total",
                 "kimi_mlx_prompt_cache_hits_total", "kimi_mlx_queue_length",
                 "kimi_mlx_generation_tokens_per_second"):
        assert name in text
    loading = make_service(MICRO, None, None, 1 << 20)
    app_srv = BackgroundServer(create_app(loading)).start()
    try:
        r = httpx.get(app_srv.url + "/health")
        assert r.status_code == 503 and "loading" in r.json()["reason"]
        r = httpx.post(app_srv.url + "/v1/chat/completions", json={"model": "micro", "messages": MSGS})
        assert r.status_code == 503 and r.headers.get("retry-after")
    finally:
        app_srv.stop()


def test_non_loopback_bind_needs_key_or_no_auth(capsys):
    class A:
        api_key = api_key_file = None
        host, no_auth = "0.0.0.0", False
    with pytest.raises(InputError, match="--no-auth"):
        resolve_api_key(A)
    A.no_auth = True
    assert resolve_api_key(A) is None and "warning" in capsys.readouterr().err
    A.host, A.no_auth = "127.0.0.1", False
    assert resolve_api_key(A) is None


def test_disconnect_frees_the_slot(server, oai):
    srv, svc = server
    before = svc.metrics.generation_tokens._value.get()
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "micro", "messages": MSGS, "max_tokens": 3000,
                            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    t0 = time.monotonic()
    r = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 60  # bounded; not a speed claim
    generated = svc.metrics.generation_tokens._value.get() - before
    assert generated < 500  # the abandoned stream stopped long before its 3000 tokens


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl(server):
    srv, _ = server
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "60", srv.url + "/v1/chat/completions",
         "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
         "-d", json.dumps({"model": "micro", "messages": MSGS, "max_tokens": 3})],
        capture_output=True, text=True, timeout=90, check=True).stdout
    assert json.loads(out)["usage"]["completion_tokens"] == 3


def test_concurrent_streams_are_isolated(server, oai):
    """8 concurrent streams (4 decode at once, 4 queue): each gets exactly what it gets
    alone; an unrelated conversation between two identical requests changes nothing."""
    import concurrent.futures as cf

    _, svc = server
    prose = open(f"{MICRO}/heldout/prose.txt").read()
    prompts = [f"Marker ZX{i}Q. " + prose[300 * i : 300 * i + 40 + 30 * i] for i in range(8)]

    def stream(prompt):
        return "".join(ch.choices[0].text for ch in oai.completions.create(
            model="micro", prompt=prompt, max_tokens=6, temperature=0, stream=True) if ch.choices)

    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(stream, prompts))
    assert len(set(together)) == 8  # different prompts, different replies: the test can fail
    assert together[:2] == [stream(p) for p in prompts[:2]]
    for i in (4, 7):  # and against the independent loop
        ref, _ = greedy_reference(svc.engine.model, svc.tok.encode(prompts[i]), 6)
        assert together[i] == svc.tok.decode(ref)
    a = stream(prompts[5])
    stream("Something unrelated entirely, much longer. " * 5)
    assert stream(prompts[5]) == a == together[5]


def test_one_at_a_time_engine_matches_batched(server):
    """--max-concurrency 1 (mlx-lm generate_step) and the batching engine agree."""
    _, real = server
    from kimi_mlx.server.engine import Engine

    engine = Engine(real.engine.model, real.tok.eos_token_ids, max_concurrency=1).start()
    srv = sibling_server(real, engine)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        kw = dict(model="micro", messages=MSGS, max_tokens=8, temperature=0.8, seed=3)
        one = c.chat.completions.create(**kw).choices[0].message.reasoning_content
        oai = openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        assert oai.chat.completions.create(**kw).choices[0].message.reasoning_content == one
    finally:
        srv.stop()
        engine.stop()


class _Refusing(BaseEngine):
    queue_length = active = 0

    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    def submit(self, job):
        from kimi_mlx.server.jobs import Busy, Failed

        if self.fail_after is None:
            raise Busy("2 requests are waiting (--max-queue 2)")

        def run():
            for t in [300, 301, 302][: self.fail_after]:
                job.emit(TokenOut(t))
            job.emit(Failed("generation failed: RuntimeError: boom"))
        threading.Thread(target=run, daemon=True).start()
        return job


def _fake_server(server, engine):
    return sibling_server(server[1], engine)


def test_busy_is_503_with_retry_after_and_failures_reach_only_that_request(server, oai):
    srv = _fake_server(server, _Refusing())
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "micro", "messages": MSGS}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/messages", json={"model": "micro", "messages": MSGS[1:], "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        srv.stop()
    srv = _fake_server(server, _Refusing(fail_after=2))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "micro", "messages": MSGS}, timeout=30)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30, json={
                "model": "micro", "messages": MSGS, "stream": True}) as s:
            lines = [l for l in s.iter_lines() if l.startswith("data: ")]
        assert s.status_code == 200 and "boom" in json.loads(lines[-1][6:])["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/messages", timeout=30, json={
                "model": "micro", "messages": MSGS[1:], "max_tokens": 5, "stream": True}) as s:
            body = s.read().decode()
        assert "event: error" in body and "boom" in body
    finally:
        srv.stop()
    # the real server is unaffected
    assert oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=2).usage.completion_tokens == 2


def test_streams_never_split_a_utf8_character(server):
    _, real = server
    text = "Smile 🙂, naïve café — 日本語 ok"
    ids = real.tok.encode(text)
    assert any("\ufffd" in real.tok.decode([t]) for t in ids)  # some tokens are partial bytes
    srv = _fake_server(server, ScriptedEngine(ids))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=30, max_retries=0)
        pieces = [ch.choices[0].text for ch in c.completions.create(
            model="micro", prompt="x", max_tokens=100, stream=True) if ch.choices]
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    finally:
        srv.stop()


def test_built_checkpoint_plain_and_streamed(tiny_ckpt):
    """The same API on a checkpoint built in the official layout (random weights)."""
    svc = make_service(str(tiny_ckpt), None, "tiny", 64 << 10)
    load_service(svc, str(tiny_ckpt), max_concurrency=2, prompt_cache_bytes=1 << 20,
                 max_queue=4, max_kv_size=1024)
    srv = BackgroundServer(create_app(svc)).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        kw = dict(model="tiny", messages=MSGS, max_tokens=5, temperature=0.7, seed=1)
        r = c.chat.completions.create(**kw)
        _, reasoning, content, _ = _stream_chat(c, **kw)
        m = r.choices[0].message
        assert (reasoning, content) == (m.reasoning_content or "", m.content)
        assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
        # --max-kv-size is the context (the Anthropic dialect refuses what passes it)
        r = httpx.post(srv.url + "/v1/messages", json={
            "model": "tiny", "messages": MSGS[1:], "max_tokens": 1000}, timeout=30)
        assert r.status_code == 400 and "> 1024," in r.json()["error"]["message"]
    finally:
        srv.stop()
        svc.engine.stop()


def test_prompt_cache_snapshots_every_n_tokens_of_a_long_prompt():
    """A long raw prompt is snapshotted every `every` tokens; a longer prompt that starts
    with it resumes from the last snapshot and gives a cold run's greedy tokens."""
    from kimi_mlx.server.engine import Engine
    from kimi_mlx.server.jobs import Job
    from kimi_mlx.server.prompt_cache import PromptCache
    from kimi_mlx.sampling import Sampling as SamplingParams
    from kimi_mlx.checkpoint.loader import load_for_generation

    model, _, tok, _ = load_for_generation(MICRO)
    pc = PromptCache(64 << 20, every=32)
    eng = Engine(model, tok.eos_token_ids, max_concurrency=1, prompt_cache=pc).start()
    try:
        ids = tok.encode(open(f"{MICRO}/heldout/code.txt").read()[:600])
        assert len(ids) > 100

        def run(prompt):
            job = Job(prompt, 5, SamplingParams())
            job.attach(None)
            eng.submit(job)
            evs = list(job.events(timeout=120))
            return [e.token for e in evs if isinstance(e, TokenOut)], evs[-1]

        run(ids[:90])
        assert len(pc) == 2  # at 32 and 64 (the prompt's last token is never snapshotted)
        toks, done = run(ids[:100])
        assert done.cached_tokens == 64
        assert toks == greedy_reference(model, ids[:100], 5)[0]
    finally:
        eng.stop()


def test_non_streamed_request_whose_client_leaves_is_stopped(server):
    srv, svc = server
    before = svc.metrics.generation_tokens._value.get()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "micro", "prompt": "Once", "max_tokens": 3000}, timeout=1.5)
    deadline = time.monotonic() + 30
    while svc.engine.active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert svc.engine.active == 0
    time.sleep(0.5)
    assert svc.metrics.generation_tokens._value.get() - before < 1000


def test_cli_serves_until_interrupted(tmp_path):
    """`kimi-mlx server` as a user runs it: key from a file, port 0, health, a request,
    Ctrl-C; and a non-loopback bind without a key is refused before anything loads."""
    import os
    import re
    import signal
    import sys

    bad = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "server", "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--no-auth" in bad.stderr
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-file-key\n")
    proc = subprocess.Popen([sys.executable, "-m", "kimi_mlx.commands.main", "server", "--port", "0",
                             "--api-key-file", str(keyfile), "--max-concurrency", "2"],
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
        url = re.search(r"http://\S+", line).group(0)
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="sk-file-key", timeout=60, max_retries=0)
        assert c.completions.create(model="micro", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sampling_defaults_from_generation_config(tmp_path):
    from kimi_mlx.generation.request import generation_defaults
    from kimi_mlx.sampling import Sampling as SamplingParams

    assert generation_defaults(tmp_path) == SamplingParams()  # no file: greedy
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "eos_token_id": 1}))
    assert generation_defaults(tmp_path) == SamplingParams(0.6, 0.95, 0.0, 40)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(tmp_path)


def test_tool_choice_and_response_format_are_encoded(server, oai):
    """tool_choice required/none and response_format json_object reach the prompt as the
    reference encoder's system blocks (never silently dropped)."""
    _, svc = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw, opts in [({"tool_choice": "required", "tools": tools}, {"tool_choice": "required"}),
                     ({"tool_choice": "none", "tools": tools}, {"tool_choice": "none"}),
                     ({"response_format": {"type": "json_object"}},
                      {"response_format": {"type": "json_object"}})]:
        r = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=1, **kw)
        want = encode_chat(svc.tok, MSGS, tools=kw.get("tools"), **opts)
        assert r.usage.prompt_tokens == len(want)
        assert len(want) > len(encode_chat(svc.tok, MSGS, tools=kw.get("tools")))


def test_prompt_and_message_ends_in_one_pass(server):
    from kimi_mlx.generation.request import build_chat_prompt_with_ends

    _, svc = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = MSGS + [{"role": "assistant", "content": "Red.", "reasoning_content": "Pick one."},
                   {"role": "user", "content": "Another <|open|> one?"}]
    ids, ends = build_chat_prompt_with_ends(svc.tok, msgs, "high", tools, tool_choice="required")
    assert ids == encode_chat(svc.tok, msgs, "high", tools=tools, tool_choice="required")
    for k in range(1, len(msgs) + 1):  # every message prefix ends at one of the positions
        assert len(encode_chat(svc.tok, msgs[:k], "high", False, tools)) in ends


def test_penalties_apply_and_are_refused_where_unsupported(server, oai):
    _, svc = server
    kw = dict(model="micro", prompt="the the the the the", max_tokens=4, temperature=0)
    forced = oai.completions.create(logit_bias={"300": 100}, **kw).choices[0].text
    assert forced == svc.tok.decode([300] * 4)  # the processors reach the sampler

    class NoPenalties(ScriptedEngine):
        supports_logits_processors = False

    srv = _fake_server(server, NoPenalties([300]))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={**kw, "presence_penalty": 1.0}, timeout=30)
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]
    finally:
        srv.stop()

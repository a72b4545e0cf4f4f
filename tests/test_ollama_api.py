"""Ollama's API (/api/*, /ollama/api/*) driven by the real `ollama` Python client (and
the `ollama` npm package, and VS Code Copilot's local-provider requests) against
`kimi-mlx server` on the shipped micro and micro-vision checkpoints, and once against
`kimi-mlx cluster server`.

The independent reference is the same engine through the OpenAI adapter: a greedy reply
to the same conversation must be the same text with the same token counts (the micro
model is not chat-tuned; equality between routes is what is checked, not quality)."""

import base64
import io
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.servers import served, sibling_server, start_server, stop_server

from fixtures.scripted import TOOL_REPLY, ScriptedEngine

KEY = "sk-ollama-test"
MICRO = str(default_model())
ROOT = Path(__file__).resolve().parents[1]
VISION = ROOT / "kimi_mlx" / "assets" / "micro-vision"
DATA = Path(__file__).resolve().parent / "data" / "ollama"
MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    with served(MICRO, KEY, None, max_concurrency=2, prompt_cache_bytes=64 << 20,
                max_queue=16) as both:
        yield both


def _clients(url, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return (ollama.Client(host=url, headers=headers, timeout=120),
            openai.OpenAI(base_url=url + "/v1", api_key=key or "x", timeout=120, max_retries=0))


@pytest.fixture(scope="module")
def ol(server):
    return _clients(server[0].url)[0]


@pytest.fixture(scope="module")
def oai(server):
    return _clients(server[0].url)[1]


def _reasoning(message) -> str:
    return (message.model_extra or {}).get("reasoning_content") or ""


def _same_reply(r, o):
    """An ollama ChatResponse equals an OpenAI chat completion of the same request."""
    m = o.choices[0].message
    assert (r.message.content or "") == (m.content or "")
    assert (r.message.thinking or "") == _reasoning(m)
    assert r.eval_count == o.usage.completion_tokens
    assert r.prompt_eval_count == o.usage.prompt_tokens
    assert r.done_reason == {"length": "length"}.get(o.choices[0].finish_reason, "stop")


def _timings(r):
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration",
              "prompt_eval_count", "eval_count"):
        assert isinstance(r[k], int) and r[k] >= 0, k
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0


# ------------------------------------------------------------------ chat / generate


def test_chat_greedy_equals_openai_route(server, ol, oai):
    r = ol.chat(model="micro", messages=MSGS, options={"temperature": 0, "num_predict": 12})
    o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=12, temperature=0)
    assert r.done and r.message.role == "assistant" and r.model == "micro"
    _same_reply(r, o)
    assert r.eval_count == 12 and r.done_reason == "length"
    assert (r.message.thinking or "") + (r.message.content or "")  # something was said
    _timings(r)
    # the tagged name Ollama clients use, and exo's /ollama prefix: the same reply
    r2 = ollama.Client(host=server[0].url + "/ollama",
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120).chat(
        model="micro:latest", messages=MSGS, options={"temperature": 0, "num_predict": 12})
    assert r2.model == "micro:latest" and r2.message == r.message


def test_chat_streamed_equals_non_streamed(server, ol):
    kw = dict(model="micro", messages=MSGS, options={"temperature": 0.9, "top_p": 0.95,
                                                      "seed": 7, "num_predict": 10})
    whole = ol.chat(**kw)
    parts = list(ol.chat(stream=True, **kw))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.thinking or "" for p in parts) == (whole.message.thinking or "")
    assert "".join(p.message.content or "" for p in parts) == (whole.message.content or "")
    assert parts[-1].eval_count == whole.eval_count == 10
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count
    _timings(parts[-1])
    # the wire: NDJSON, one object per line, Ollama's default is to stream
    with httpx.stream("POST", server[0].url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "micro", "messages": MSGS, "options": {"num_predict": 3}},
                      timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in resp.iter_lines() if x]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3


def test_think_maps_to_reasoning_effort(ol, oai):
    for think, effort in ((False, "none"), ("low", "low"), ("medium", "medium"), ("high", "high")):
        r = ol.chat(model="micro", messages=MSGS, think=think,
                    options={"temperature": 0, "num_predict": 6})
        o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=6,
                                        temperature=0, reasoning_effort=effort)
        _same_reply(r, o)
    # think true is the default effort: the same prompt as no think at all
    a = ol.chat(model="micro", messages=MSGS, think=True, options={"temperature": 0, "num_predict": 4})
    b = ol.chat(model="micro", messages=MSGS, options={"temperature": 0, "num_predict": 4})
    assert a.prompt_eval_count == b.prompt_eval_count and a.message == b.message


def test_options_map_to_sampling(ol, oai):
    opts = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11,
            "repeat_penalty": 1.3, "repeat_last_n": 16, "num_predict": 10,
            "num_ctx": 999999, "mirostat": 2, "num_gpu": 99}  # the last three: ignored
    r = ol.chat(model="micro", messages=MSGS, options=opts)
    o = oai.chat.completions.create(
        model="micro", messages=MSGS, max_tokens=10, temperature=0.9, top_p=0.9, seed=11,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3,
                    "repetition_context_size": 16})
    _same_reply(r, o)
    # a strong penalty changes a greedy reply (the micro model repeats itself), as OpenAI's
    hard = {"temperature": 0, "num_predict": 24, "repeat_penalty": 5.0, "repeat_last_n": 64}
    r = ol.chat(model="micro", messages=MSGS, options=hard)
    o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=24, temperature=0,
                                    extra_body={"repetition_penalty": 5.0,
                                                "repetition_context_size": 64})
    _same_reply(r, o)
    plain = ol.chat(model="micro", messages=MSGS, options={"temperature": 0, "num_predict": 24})
    assert plain.message != r.message
    off = ol.chat(model="micro", messages=MSGS, options={**hard, "repeat_last_n": 0})
    assert off.message == plain.message  # repeat_last_n 0: no penalty, as in Ollama
    # a stop string across tokens, as OpenAI's stop (it cuts the reply's text, so a raw
    # generate, whose micro reply is all text)
    base = ol.generate(model="micro", prompt="Once upon a time", raw=True,
                       options={"temperature": 0, "num_predict": 16})
    stop = base.response.strip()[3:7]
    s = ol.generate(model="micro", prompt="Once upon a time", raw=True,
                    options={"temperature": 0, "num_predict": 16, "stop": [stop]})
    c = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=16,
                               temperature=0, stop=[stop])
    assert s.response == c.choices[0].text and stop not in s.response
    assert s.eval_count < 16 and s.done_reason == "stop"


def test_generate_chat_and_raw(server, ol, oai):
    r = ol.generate(model="micro", system="You are terse.", prompt="Name a colour.",
                    options={"temperature": 0, "num_predict": 10})
    o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=10, temperature=0)
    assert (r.response or "") == (o.choices[0].message.content or "")
    assert (r.thinking or "") == _reasoning(o.choices[0].message)
    assert r.eval_count == o.usage.completion_tokens and r.prompt_eval_count == o.usage.prompt_tokens
    _timings(r)
    # raw: the prompt as-is, as /v1/completions reads a string
    raw = ol.generate(model="micro", prompt="Once upon a time", raw=True,
                      options={"temperature": 0, "num_predict": 12})
    c = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert raw.response == c.choices[0].text and raw.thinking is None
    assert raw.prompt_eval_count == c.usage.prompt_tokens and raw.eval_count == 12
    parts = list(ol.generate(model="micro", prompt="Once upon a time", raw=True, stream=True,
                             options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done
    # an empty prompt loads the model (Ollama's preload idiom)
    empty = ol.generate(model="micro", prompt="", keep_alive="10m")
    assert empty.done and empty.done_reason == "load" and empty.response == ""


# ------------------------------------------------------------------ model info


def test_tags_show_ps_version(server, ol):
    url, svc = server[0].url, server[1]
    tags = ol.list()
    assert [m.model for m in tags.models] == ["micro"] and tags.models[0].digest.startswith("sha256:")
    info = ol.show("micro:latest")
    arch = info.modelinfo["general.architecture"]
    assert arch == "kimi_k31" and info.modelinfo[f"{arch}.context_length"] == svc.context == 4096
    assert info.capabilities == ["completion", "tools", "thinking"]  # no vision tower in micro
    ps = ol.ps()
    assert [(m.model, m.context_length) for m in ps.models] == [("micro", 4096)]
    v = httpx.get(url + "/api/version").json()
    assert list(v) == ["version"] and all(p.isdigit() for p in v["version"].split("."))
    assert tuple(map(int, v["version"].split("."))) >= (0, 6, 4)  # Copilot's minimum
    h = {"Authorization": f"Bearer {KEY}"}
    for path in ("/tags", "/ps", "/version"):
        assert httpx.get(url + "/ollama/api" + path, headers=h).json() == \
            httpx.get(url + "/api" + path, headers=h).json()


# ------------------------------------------------------------------ errors


def test_errors_in_ollama_shape(server, ol):
    url = server[0].url
    for call in (lambda: ol.chat(model="nope", messages=MSGS),
                 lambda: ol.generate(model="nope", prompt="x"),
                 lambda: ol.show("nope")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "'nope' not found" in e.value.error
    h = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ({"model": "micro", "messages": MSGS, "options": {"temperature": 9}}, "options.temperature"),
        ({"model": "micro", "messages": MSGS, "options": {"num_predict": 0}}, "options.num_predict"),
        ({"model": "micro", "messages": MSGS, "think": "ultra"}, "think"),
        ({"model": "micro", "messages": MSGS, "format": 5}, "format"),
        ({"model": "micro", "messages": MSGS, "format": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(?=x)"}}}}, "format"),
        ({"model": "micro", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"model": "micro", "messages": [{"role": "user", "content": "x", "images": ["bm90IGFuIGltYWdl"]}]},
         "messages[0].images[0]"),
        ({"model": "micro", "messages": [{"role": "user", "content": "hello " * 5000}]}, "4096"),
        ({"model": "micro", "messages": MSGS, "stream": "yes"}, "stream"),
    ]
    for body, needle in cases:
        for stream in (False, True):
            r = httpx.post(url + "/api/chat", headers=h, json={"stream": stream, **body}
                           if "stream" not in body else body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            assert list(r.json()) == ["error"] and needle in r.json()["error"], (needle, r.text)
    for body, needle in (({"model": "micro", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
                         ({"model": "micro", "prompt": "x", "suffix": "y"}, "suffix"),
                         ({"model": "micro", "prompt": "x", "context": [1, 2]}, "context"),
                         ({"model": "micro", "prompt": "x", "raw": True, "format": "json"}, "format")):
        r = httpx.post(url + "/api/generate", headers=h, json=body, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"], r.text
    r = httpx.post(url + "/api/chat", headers={**h, "content-type": "application/json"},
                   content=b"{not json", timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(url + "/api/show", headers=h, json={}, timeout=60)
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    r = httpx.get(url + "/api/tags", timeout=60)  # the server's key holds here too
    assert r.status_code == 401 and list(r.json()) == ["error"]
    assert httpx.get(url + "/api/nothing", headers=h).json() == {"error": "no route GET /api/nothing"}


# ------------------------------------------------------------------ format (grammar)


def test_format_schema_and_json_replies_validate(ol, oai):
    schema = {"type": "object", "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"], "additionalProperties": False}
    for seed in (1, 2, 3):
        r = ol.chat(model="micro", messages=[{"role": "user", "content": "A colour and a count."}],
                    format=schema, think="low",
                    options={"temperature": 0.8, "seed": seed, "num_predict": 96,
                             "thinking_budget": 6})
        jsonschema.validate(json.loads(r.message.content), schema)
    # "json": the OpenAI route's json_object, token for token
    q = [{"role": "user", "content": "JSON please."}]
    r = ol.chat(model="micro", messages=q, format="json", think="low",
                options={"temperature": 0.8, "seed": 5, "num_predict": 48, "thinking_budget": 6})
    o = oai.chat.completions.create(model="micro", messages=q, max_tokens=48, temperature=0.8,
                                    seed=5, response_format={"type": "json_object"},
                                    extra_body={"thinking_budget": 6, "reasoning_effort": "low"})
    _same_reply(r, o)
    assert r.message.content.lstrip().startswith("{")
    # generate takes format too; streamed pieces join to the same valid reply
    parts = list(ol.generate(model="micro", prompt="A colour and a count.", format=schema,
                             think="low", stream=True,
                             options={"temperature": 0.8, "seed": 1, "num_predict": 96,
                                      "thinking_budget": 6}))
    jsonschema.validate(json.loads("".join(p.response for p in parts)), schema)


# ------------------------------------------------------------------ tools


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "number"}},
                   "required": ["city"]}}}]


def test_tool_history_gives_the_openai_prompt_and_reply(ol, oai):
    """A conversation with a tool call and its result: Ollama's form (arguments an object,
    the result named by tool_name) encodes to the same prompt as OpenAI's form."""
    olm = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
           {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    oam = [olm[0], {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = ol.chat(model="micro", messages=olm, tools=TOOLS, options={"temperature": 0, "num_predict": 8})
    o = oai.chat.completions.create(model="micro", messages=oam, tools=TOOLS, max_tokens=8, temperature=0)
    _same_reply(r, o)
    no_tools = ol.chat(model="micro", messages=olm[:1], options={"temperature": 0, "num_predict": 1})
    assert r.prompt_eval_count > no_tools.prompt_eval_count + 20  # the tools are in the prompt


def test_tool_calls_parse_streamed_and_not(server):
    real = server[1]
    srv = sibling_server(real, ScriptedEngine(real.tok.encode(TOOL_REPLY, allow_special=True)))
    try:
        c = ollama.Client(host=srv.url, timeout=60)
        kw = dict(model="micro", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
        r = c.chat(**kw)
        assert r.message.thinking == "Let me look." and r.message.content == "Checking."
        [call] = r.message.tool_calls
        assert call.function.name == "get_weather"
        assert call.function.arguments == {"city": "Paris é", "days": 3}  # an object
        assert r.done_reason == "stop"
        parts = list(c.chat(stream=True, **kw))
        calls = [t for p in parts for t in (p.message.tool_calls or [])]
        assert [(t.function.name, dict(t.function.arguments)) for t in calls] == \
            [("get_weather", {"city": "Paris é", "days": 3})]
        assert "".join(p.message.content or "" for p in parts) == "Checking."
        raw = httpx.post(srv.url + "/api/chat", json={**kw, "stream": False}).json()
        assert raw["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris é", "days": 3}
    finally:
        srv.stop()


# ------------------------------------------------------------------ images (micro-vision)


def _png(shape="circle", colour="red", seed=0) -> bytes:
    from kimi_mlx.micro.vision_train import draw

    buf = io.BytesIO()
    draw(shape, colour, np.random.default_rng(seed)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.skipif(not (VISION / "config.json").exists(), reason="micro-vision not shipped")
def test_images_on_micro_vision_equal_openai_image_parts():
    srv, svc = start_server(str(VISION), None, "micro-vision", 8 << 20)
    try:
        ol, oai = _clients(srv.url, key=None)
        assert "vision" in ol.show("micro-vision").capabilities
        png = _png()
        q = "What shape is this?"
        r = ol.chat(model="micro-vision", messages=[{"role": "user", "content": q, "images": [png]}],
                    options={"temperature": 0, "num_predict": 12})
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        o = oai.chat.completions.create(model="micro-vision", max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": q},
                                         {"type": "image_url", "image_url": {"url": url}}]}])
        _same_reply(r, o)
        text_only = ol.chat(model="micro-vision", messages=[{"role": "user", "content": q}],
                            options={"temperature": 0, "num_predict": 1})
        assert r.prompt_eval_count > text_only.prompt_eval_count  # the image's tokens
        # generate's images, and a second picture that differs gives a different reply
        g = ol.generate(model="micro-vision", prompt=q, images=[png],
                        options={"temperature": 0, "num_predict": 12})
        assert (g.response, g.thinking) == (r.message.content or "", r.message.thinking)
        other = ol.chat(model="micro-vision", messages=[{"role": "user", "content": q,
                        "images": [_png("square", "blue", 1)]}],
                        options={"temperature": 0, "num_predict": 12})
        assert other.prompt_eval_count == r.prompt_eval_count and other.message != r.message
    finally:
        stop_server(srv, svc)


# ------------------------------------------------------------------ VS Code Copilot


def _replay(url: str, fixture: str) -> httpx.Response:
    req = json.loads((DATA / fixture).read_text())
    # a header value's trailing space is not on the wire (RFC 9110 5.5): "Bearer " arrives "Bearer"
    headers = {k: v.strip() for k, v in req["headers"].items()}
    return httpx.request(req["method"], url + req["path"], headers=headers,
                         content=json.dumps(req["body"]) if "body" in req else None, timeout=120)


def test_copilot_local_provider_requests(server):
    """The requests VS Code Copilot's Ollama provider sends (tests/data/ollama/copilot_*.json;
    an empty bearer token, as it sends one) answered with the fields it reads."""
    srv = sibling_server(server[1], api_key=None)  # Copilot sends no key
    try:
        v = _replay(srv.url, "copilot_version.json").json()["version"]
        assert tuple(int(x) for x in v.split(".")) >= (0, 6, 4)  # its _isVersionSupported
        models = _replay(srv.url, "copilot_tags.json").json()["models"]
        assert [m["model"] for m in models] == ["micro"]
        show = _replay(srv.url, "copilot_show.json").json()
        info = show["model_info"]
        assert info[f"{info['general.architecture']}.context_length"] == 4096
        assert info["general.basename"] == "micro"
        assert "tools" in show["capabilities"] and "vision" not in show["capabilities"]
        r = _replay(srv.url, "copilot_chat_completions.json")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] > 0  # stream_options.include_usage
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
        assert all(c["model"] == "micro" for c in chunks)
    finally:
        srv.stop()


# ------------------------------------------------------------------ the ollama npm package

NODE_SCRIPT = r"""
const { Ollama } = require('ollama');
(async () => {
  const o = new Ollama({ host: process.argv[2] });
  const msgs = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Name a colour.' }];
  const opts = { temperature: 0, num_predict: 8 };
  const out = {};
  out.chat = await o.chat({ model: 'micro', messages: msgs, options: opts });
  let think = '', content = '', last = null;
  for await (const p of await o.chat({ model: 'micro', messages: msgs, options: opts, stream: true })) {
    think += p.message.thinking || ''; content += p.message.content || ''; last = p;
  }
  out.stream = { thinking: think, content, last };
  out.generate = await o.generate({ model: 'micro', prompt: 'Once upon a time', raw: true, options: { temperature: 0, num_predict: 8 } });
  out.list = await o.list();
  out.show = await o.show({ model: 'micro' });
  out.ps = await o.ps();
  try { await o.chat({ model: 'nope', messages: msgs }); } catch (e) { out.error = { name: e.name, message: e.message, status: e.status_code }; }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def _ollama_js() -> Path:
    return ROOT / ".clients" / "node_modules" / "ollama"


@pytest.mark.clients
@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_ollama_npm_client(server, oai, tmp_path):
    if not _ollama_js().exists():
        pytest.skip("the ollama npm package is not installed (make clients)")
    srv = sibling_server(server[1], api_key=None)
    try:
        script = tmp_path / "run.cjs"
        script.write_text(NODE_SCRIPT)
        p = subprocess.run(["node", str(script), srv.url], capture_output=True, text=True,
                           timeout=300, env={"NODE_PATH": str(ROOT / ".clients" / "node_modules"),
                                             "PATH": "/usr/bin:/bin"})
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
    finally:
        srv.stop()
    o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=8, temperature=0)
    m = o.choices[0].message
    assert out["chat"]["message"]["content"] == (m.content or "")
    assert out["chat"]["message"].get("thinking", "") == _reasoning(m)
    assert out["chat"]["eval_count"] == o.usage.completion_tokens == 8
    assert out["stream"]["thinking"] == _reasoning(m) and out["stream"]["content"] == (m.content or "")
    assert out["stream"]["last"]["done"] is True and out["stream"]["last"]["done_reason"] == "length"
    c = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out["generate"]["response"] == c.choices[0].text
    assert [m["model"] for m in out["list"]["models"]] == ["micro"]
    assert out["show"]["model_info"]["kimi_k31.context_length"] == 4096
    assert "tools" in out["show"]["capabilities"]
    assert out["ps"]["models"][0]["model"] == "micro"
    assert out["error"]["status"] == 404 and "not found" in out["error"]["message"]


# ------------------------------------------------------------------ cluster server


def test_cluster_server_speaks_ollama(micro_pipeline):
    """`kimi-mlx cluster server` builds the same app: the Ollama routes answer through
    the pipeline (the session's 3 stages, tests/fixtures/shared.py, only read here) with
    the OpenAI route's greedy reply."""
    from kimi_mlx.testing.cluster import ServerProc
    from kimi_mlx.testing.ports import free_ports

    server = None
    try:
        server = ServerProc(micro_pipeline, free_ports(1)[0])
        ol, oai = _clients(server.url, key=None)
        r = ol.chat(model="micro", messages=MSGS, options={"temperature": 0, "num_predict": 6})
        o = oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=6, temperature=0)
        _same_reply(r, o)
        parts = list(ol.generate(model="micro", prompt="Once upon a time", raw=True, stream=True,
                                 options={"temperature": 0, "num_predict": 6}))
        c = oai.completions.create(model="micro", prompt="Once upon a time", max_tokens=6, temperature=0)
        assert "".join(p.response for p in parts) == c.choices[0].text and parts[-1].done
        assert ol.show("micro").modelinfo["kimi_k31.context_length"] > 0
    finally:
        if server is not None:
            server.stop()

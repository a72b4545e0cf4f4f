"""Images through `kimi-mlx server` on a random checkpoint with vision weights (official
layout), driven by the real `openai` and `anthropic` clients and curl: greedy replies equal
a cache-free reference over the same image embeddings and `kimi-mlx generate --image`;
`count_tokens` counts the rule's image tokens; the prompt cache never shares a prefix past
an image that differs; every error is a 400 naming the image and why."""

import base64
import http.server
import io
import json
import shutil
import subprocess
import threading

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest
from PIL import Image

from kimi_mlx.speculative.settings import DraftSettings
from kimi_mlx.commands.main import main
from kimi_mlx.generation.images import Vision
from kimi_mlx.generation.request import build_chat_prompt_with_ends, build_prompt
from kimi_mlx.testing.servers import start_server, stop_server
from kimi_mlx.testing.checkpoints import (argmax_margin, build_checkpoint, model_tolerance,
                                          tiny_text_config, tiny_vision_config)
from kimi_mlx.text.chat_format import ReplyStream
from kimi_mlx.vision.preprocess import token_count

KEY = "sk-test"


@pytest.fixture(scope="module")
def vckpt(tmp_path_factory):
    # every expert active: no routing near-ties between cached and uncached decoding
    text = tiny_text_config(num_experts_per_token=8)
    return build_checkpoint(tmp_path_factory.mktemp("vsrv") / "tiny", text_config=text, seed=2,
                            conditioned=True, vision=tiny_vision_config())


def _serve(ckpt, **kw):
    return start_server(str(ckpt), KEY, "tiny", 8 << 20, **kw)


@pytest.fixture(scope="module")
def server(vckpt):
    srv, svc = _serve(vckpt)
    yield srv, svc
    stop_server(srv, svc)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server[0].url, api_key=KEY, timeout=120, max_retries=0)


def png(w, h, seed, fmt="PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def greedy_reference(model, vision, pad, ids, images, n, eos):
    """n greedy tokens by a full forward over [prompt embeddings (images in) + the
    generated tokens' embeddings] at every step: no cache, no engine, no mlx-lm."""
    prompt = model.embed_with_media(mx.array(ids), vision.features(images), pad)
    tol = model_tolerance(model.args, len(ids) + n)
    out = []
    for _ in range(n):
        emb = mx.concatenate([prompt, model.text.embed(mx.array(out, mx.int32))]) if out else prompt
        logits = model(mx.array([ids + out]), input_embeddings=emb[None])
        assert argmax_margin(logits[0, -1]) >= tol, "near tie in the greedy token"
        t = int(mx.argmax(logits[0, -1]).item())
        if t in eos:
            break
        out.append(t)
    return out


def reference(svc, messages, images, n, effort="low"):
    """(prompt ids, greedy reference tokens) of chat_format `messages` with resolved images."""
    ids, _ = build_chat_prompt_with_ends(svc.tok, messages, effort)
    vision = svc.images.vision
    return ids, greedy_reference(svc.engine.model, vision, svc.images.pad_id, ids, images, n,
                                 set(svc.tok.eos_token_ids))


def token_bytes(choice):
    return [bytes(e.bytes) for e in choice.logprobs.content]


def test_openai_image_equals_reference_and_generate(server, oai, vckpt, tmp_path, capsys):
    srv, svc = server
    raw = png(112, 84, 0)
    prompt = "What is this?"
    r = oai.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0, logprobs=True, reasoning_effort="low",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(raw)}},
            {"type": "text", "text": prompt}]}])
    im = Vision(vckpt).load_image(raw)
    ids = build_prompt(svc.tok, prompt, None, False, "low", [im])
    text_only = build_prompt(svc.tok, prompt, None, False, "low")
    # the rule: markers (3) + "image 112x84" + the pads
    assert token_count(112, 84) == 12
    assert r.usage.prompt_tokens == len(ids) == (len(text_only) + 3 + 12
                                                 + len(svc.tok.encode("image 112x84")))
    want = greedy_reference(svc.engine.model, svc.images.vision, svc.images.pad_id, ids, [im], 6,
                            set(svc.tok.eos_token_ids))
    assert token_bytes(r.choices[0]) == [svc.tok.decode_bytes([t]) for t in want]
    # the independent path: `kimi-mlx generate --image` on the same checkpoint
    path = tmp_path / "a.png"
    path.write_bytes(raw)
    code = main(["generate", "--model", str(vckpt), "--prompt", prompt, "--image", str(path),
                 "--max-tokens", "6", "--reasoning-effort", "low"])
    out = capsys.readouterr().out
    assert code == 0
    stream = ReplyStream()
    events = stream.feed(svc.tok.decode(want)) + stream.finish()
    assert out.split("=" * 10)[1].strip("\n") == "".join(t for _, t in events)


def test_openai_stream_and_concurrency_one(vckpt, server):
    """The same request streamed, and on a one-at-a-time engine (generate_step path),
    gives the batched server's tokens."""
    srv1, svc1 = _serve(vckpt, max_concurrency=1)
    try:
        msgs = [{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": data_url(png(56, 70, 5, "JPEG"), "image/jpeg")}}]}]
        outs = []
        for url in (server[0].url, srv1.url):
            c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)
            r = c.chat.completions.create(model="tiny", max_tokens=5, temperature=0, logprobs=True,
                                          messages=msgs)
            outs.append(token_bytes(r.choices[0]))
            chunks = list(c.chat.completions.create(model="tiny", max_tokens=5, temperature=0,
                                                    logprobs=True, messages=msgs, stream=True))
            outs.append([bytes(e.bytes) for ch in chunks if ch.choices and ch.choices[0].logprobs
                         for e in ch.choices[0].logprobs.content])
        assert outs[0] and all(o == outs[0] for o in outs)
    finally:
        stop_server(srv1, svc1)


def _b64_block(raw, media="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": media,
                                        "data": base64.b64encode(raw).decode()}}


def test_anthropic_image_block_and_count_tokens(server, ant, vckpt):
    srv, svc = server
    raw = png(60, 30, 1, "WEBP")
    msgs = [{"role": "user", "content": [_b64_block(raw, "image/webp"),
                                         {"type": "text", "text": "Describe."}]}]
    n = ant.messages.count_tokens(model="tiny", messages=msgs).input_tokens
    im = Vision(vckpt).load_image(raw)
    text = [{"role": "user", "content": "Describe."}]
    n_text = ant.messages.count_tokens(model="tiny", messages=text).input_tokens
    assert token_count(60, 30) == im.num_tokens == 6
    assert n == n_text + 3 + len(svc.tok.encode("image 60x30")) + token_count(60, 30)
    r = ant.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0}, messages=msgs,
                            thinking={"type": "disabled"})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    ids, want = reference(svc, [{"role": "user", "content": [
        {"type": "image", "media": im}, {"type": "text", "text": "Describe."}]}], [im], 4)
    assert len(ids) == n
    assert r.usage.output_tokens == len(want)
    # the reply is the reference tokens' text (split into reasoning / content as the
    # server's reply builder splits any tokens), streamed or not
    from kimi_mlx.server.reply import ReplyBuilder

    b = ReplyBuilder(svc.wrapper, chat=True)
    for t in want:
        b.feed(t)
    b.finish()
    text = "".join(x.text for x in r.content if x.type == "text")
    assert text == b.content
    assert text or b.reasoning  # (the thinking block is left out with thinking disabled)
    with ant.messages.stream(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                             messages=msgs, thinking={"type": "disabled"}) as st:
        streamed = st.get_final_message()
    assert "".join(x.text for x in streamed.content if x.type == "text") == text


def test_anthropic_image_in_tool_result(server, ant, vckpt):
    srv, svc = server
    raw = png(84, 56, 2)
    tools = [{"name": "screenshot", "description": "take a screenshot",
              "input_schema": {"type": "object", "properties": {}}}]
    msgs = [{"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "functions.screenshot:0",
                                               "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.screenshot:0",
                                          "content": [{"type": "text", "text": "here"},
                                                      _b64_block(raw)]}]}]
    n = ant.messages.count_tokens(model="tiny", messages=msgs, tools=tools).input_tokens
    r = ant.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0}, messages=msgs, tools=tools)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    im = Vision(vckpt).load_image(raw)
    chat = [{"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.screenshot:0",
             "type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "functions.screenshot:0", "name": "screenshot",
             "content": [{"type": "text", "text": "here"}, {"type": "image", "media": im}]}]
    oa_tools = [{"type": "function", "function": {"name": "screenshot", "description": "take a screenshot",
                                                  "parameters": {"type": "object", "properties": {}}}}]
    ids, _ = build_chat_prompt_with_ends(svc.tok, chat, "max", oa_tools)
    assert n == len(ids)
    assert ids.count(svc.images.pad_id) == token_count(84, 56)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_data_url(server, oai):
    srv, svc = server
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png(28, 28, 7, "GIF"), "image/gif")}},
                {"type": "text", "text": "hi"}]}]}
    out = subprocess.run(["curl", "-sS", "--max-time", "120", "-H", f"Authorization: Bearer {KEY}",
                          "-H", "Content-Type: application/json", "--data-binary", "@-",
                          srv.url + "/v1/chat/completions"], input=json.dumps(body).encode(),
                         capture_output=True, timeout=150, check=True).stdout
    got = json.loads(out)
    r = oai.chat.completions.create(**body)
    assert got["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    assert [bytes(e["bytes"]) for e in got["choices"][0]["logprobs"]["content"]] == token_bytes(r.choices[0])


def test_cache_keyed_on_image_bytes(server, oai, vckpt):
    """Same text, image A then image B: B's reply equals a fresh run with B, and its
    cached tokens stop before the first image; A again reuses past the image."""
    srv, svc = server
    a, b = png(56, 56, 10), png(56, 56, 11)

    def msgs(raw):
        return [{"role": "system", "content": "You look at pictures."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw)}},
                                             {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": "More?"}]

    def ask(raw):
        return oai.chat.completions.create(model="tiny", max_tokens=5, temperature=0, logprobs=True,
                                           messages=msgs(raw))

    ra, rb, ra2 = ask(a), ask(b), ask(a)
    vision = Vision(vckpt)
    ims = {raw: vision.load_image(raw) for raw in (a, b)}
    chat = msgs(b)
    chat[1] = {"role": "user", "content": [{"type": "image", "media": ims[b]},
                                           {"type": "text", "text": "What is it?"}]}
    ids, want_b = reference(svc, chat, [ims[b]], 5, effort="max")
    first_pad = ids.index(svc.images.pad_id)
    assert token_bytes(rb.choices[0]) == [svc.tok.decode_bytes([t]) for t in want_b]
    assert rb.usage.prompt_tokens_details.cached_tokens <= first_pad
    assert ra2.usage.prompt_tokens_details.cached_tokens > first_pad
    assert token_bytes(ra2.choices[0]) == token_bytes(ra.choices[0])
    assert token_bytes(ra.choices[0]) != token_bytes(rb.choices[0])  # the image matters


def _error(call):
    with pytest.raises(Exception) as e:
        call()
    assert getattr(e.value, "status_code", None) == 400, e.value
    return str(e.value)


def test_image_errors(server, oai, ant, vckpt, tmp_path):
    srv, svc = server
    user = lambda *parts: [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]  # noqa: E731
    ask = lambda msgs, **kw: oai.chat.completions.create(model="tiny", max_tokens=2, messages=msgs, **kw)  # noqa: E731
    msg = _error(lambda: ask(user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})))
    assert "messages[0].content[1]" in msg and "--allow-image-urls" in msg
    msg = _error(lambda: ask(user({"type": "image_url", "image_url": {
        "url": data_url(b"\x89PNG\r\n\x1a\nnot really")}})))
    assert "messages[0].content[1]" in msg and "corrupt" in msg
    msg = _error(lambda: ask(user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}})))
    assert "messages[0].content[1]" in msg and "base64" in msg
    msg = _error(lambda: ask(user({"type": "image_url", "image_url": {"url": data_url(png(8, 8, 0), "image/bmp")}})))
    assert "image/bmp" in msg
    many = [{"type": "image_url", "image_url": {"url": data_url(png(28, 28, i))}} for i in range(33)]
    msg = _error(lambda: ask(user(*many)))
    assert "33 images" in msg and "at most 32" in msg
    msg = _error(lambda: ant.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]))
    assert "messages[0].content[0]" in msg and "--allow-image-urls" in msg
    msg = _error(lambda: ant.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": [_b64_block(b"GIF89a broken", "image/gif")]}]}]))
    assert "messages[0].content[0].content[0]" in msg
    # the server still answers a good request
    r = ask(user({"type": "image_url", "image_url": {"url": data_url(png(28, 28, 1))}}))
    assert r.choices[0].finish_reason in ("length", "stop")


def test_image_limits_and_no_vision(vckpt, tmp_path):
    srv, svc = _serve(vckpt, max_kv_size=200, max_images=2)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        big = data_url(png(448, 448, 0))  # 256 image tokens > the 200-token context
        msg = _error(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}]}]))
        assert "1 image(s) take 256 tokens" in msg and "context is 200 tokens" in msg
        three = [{"type": "image_url", "image_url": {"url": data_url(png(28, 28, i))}} for i in range(3)]
        msg = _error(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": three}]))
        assert "3 images" in msg and "at most 2" in msg
    finally:
        stop_server(srv, svc)
    text_only = build_checkpoint(tmp_path / "text", extras=False)
    srv, svc = _serve(text_only)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        msg = _error(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(28, 28, 0))}}]}]))
        assert "messages[0].content[0]" in msg and "no vision weights" in msg
    finally:
        stop_server(srv, svc)


class _Files(http.server.BaseHTTPRequestHandler):
    files = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        data = self.files.get(self.path)
        self.send_response(200 if data else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *a):
        pass


def test_allow_image_urls_fetches(vckpt):
    raw = png(56, 28, 4)
    _Files.files = {"/a.png": raw, "/big.png": b"x" * (21 << 20)}
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    srv, svc = _serve(vckpt, allow_image_urls=True)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)

        def ask(url):
            return c.chat.completions.create(model="tiny", max_tokens=3, temperature=0, logprobs=True,
                                             messages=[{"role": "user", "content": [
                                                 {"type": "image_url", "image_url": {"url": url}}]}])

        assert token_bytes(ask(base + "/a.png").choices[0]) == token_bytes(ask(data_url(raw)).choices[0])
        msg = _error(lambda: ask(base + "/missing.png"))
        assert "HTTP 404" in msg
        msg = _error(lambda: ask(base + "/big.png"))
        assert "over the limit" in msg
    finally:
        stop_server(srv, svc)
        files.shutdown()


def test_responses_input_image(server, oai):
    url = data_url(png(70, 42, 3))
    r = oai.responses.create(model="tiny", max_output_tokens=5, temperature=0,
                             reasoning={"effort": "low"}, input=[{"role": "user", "content": [
                                 {"type": "input_image", "image_url": url},
                                 {"type": "input_text", "text": "What is this?"}]}])
    c = oai.chat.completions.create(model="tiny", max_tokens=5, temperature=0, reasoning_effort="low",
                                    messages=[{"role": "user", "content": [
                                        {"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is this?"}]}])
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")
    msg = _error(lambda: oai.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://example.com/x.png"}]}]))
    assert "input[0].content[0]" in msg and "--allow-image-urls" in msg


def test_responses_continuation_keeps_the_image(server, oai):
    """previous_response_id: the stored conversation keeps the image (as its bytes) and
    the next turn's prompt is the whole conversation's, image included, as the chat API
    builds it from the same messages."""
    srv, svc = server
    url = data_url(png(56, 42, 8))
    first = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is this?"}]
    r1 = oai.responses.create(model="tiny", max_output_tokens=4, temperature=0,
                              reasoning={"effort": "low"}, input=[{"role": "user", "content": first}])
    r2 = oai.responses.create(model="tiny", max_output_tokens=4, temperature=0,
                              reasoning={"effort": "low"}, previous_response_id=r1.id, input="More?")
    stored = svc.responses.get(r1.id)
    assert stored[0]["content"][0].keys() == {"type", "data"}  # bytes, not patches
    reasoning = "".join(c.text for item in r1.output if item.type == "reasoning"
                        for c in (item.content or []))
    c = oai.chat.completions.create(model="tiny", max_tokens=1, temperature=0, reasoning_effort="low",
                                    messages=[{"role": "user", "content": [
                                        {"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is this?"}]},
                                        {"role": "assistant", "content": r1.output_text,
                                         "reasoning_content": reasoning},
                                        {"role": "user", "content": "More?"}])
    assert r2.usage.input_tokens == c.usage.prompt_tokens
    assert r2.usage.input_tokens > r1.usage.input_tokens + 6


def test_images_with_a_draft_are_refused_by_name(vckpt):
    srv, svc = _serve(vckpt, max_concurrency=1,
                      drafts=DraftSettings(kind="ngram", ngram_max=3, ngram_min=1))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
        msg = _error(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(28, 28, 0))}}]}]))
        assert "messages[0].content[0]" in msg and "speculative decoding" in msg
        assert c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).choices[0].finish_reason in ("length", "stop")
    finally:
        stop_server(srv, svc)

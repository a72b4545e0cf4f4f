"""No request can fail or poison another (issue 26): every sampling parameter is checked
against the model before admission (a 400 naming the field and its range), and what
still slips through fails that request alone: the other rows of its batch give the same
tokens as a run in which it never came, and unseeded sampling keeps working afterwards
(mlx-lm's compiled samplers share MLX's global random state; an exception inside one
used to leave it broken for every later request).

The bad requests here bypass the API's checks (jobs built by hand) to reach the engine
as a bug would; the reference is the same engine run without them."""

import json
import threading

import httpx
import mlx.core as mx
import openai
import pytest

from kimi_mlx.server.engine_base import BaseEngine
from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.text.chat_format import encode_chat
from kimi_mlx.generation.request import default_model
from kimi_mlx.sampling import Sampling as SamplingParams
from kimi_mlx.speculative.settings import DraftSettings
from kimi_mlx.server.app import create_app
from kimi_mlx.server.common import n_vocab
from kimi_mlx.server.engine import Engine
from kimi_mlx.server.jobs import Failed, Finished, Job, TokenOut
from kimi_mlx.server.serving import BackgroundServer, load_service, make_service

MICRO = str(default_model())
DRAFT = str(default_model().parent / "micro-draft")
MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def micro():
    model, wrapper, tok, _ = load_for_generation(MICRO)
    return model, wrapper, tok


def _job(ids, n, sampling=None, processors=None):
    job = Job(list(ids), n, sampling or SamplingParams(), logits_processors=processors)
    job.attach(None)
    return job


def _collect(job):
    events = list(job.events(timeout=120))
    tokens = [e.token for e in events if isinstance(e, TokenOut)]
    return tokens, events[-1]


def _raising_processor(tokens, logits):
    raise RuntimeError("this row's own processor failed")


def _bad_jobs(vocab):
    """name -> (job factory, text its failure must carry): a top_k the compiled sampler
    refuses (it raises inside a function sharing the random state), a logits processor
    that raises, a seed the PRNG cannot take (fails while admitted)."""
    return {
        "top_k": (lambda ids: _job(ids, 6, SamplingParams(temp=1.0, top_k=vocab)), "top_k"),
        "processor": (lambda ids: _job(ids, 6, processors=[_raising_processor]),
                      "own processor failed"),
        "seed": (lambda ids: _job(ids, 6, SamplingParams(temp=1.0, seed=-1)), "TypeError"),
    }


PROMPTS = [[5, 17, 33, 90, 4, 8], [200, 201, 7, 3], [44, 45, 46, 47, 48, 49, 50, 12], [9, 9, 9]]


def _unseeded_sample_works(engine, n=5):
    """An unseeded temperature-1 request on a running engine generates its tokens."""
    job = engine.submit(_job(PROMPTS[0], n, SamplingParams(temp=1.0, top_p=0.9, top_k=50)))
    tokens, last = _collect(job)
    assert isinstance(last, Finished), last
    assert last.reason in ("length", "stop") and len(tokens) == last.generation_tokens > 0


@pytest.mark.parametrize("kind", ["top_k", "processor", "seed"])
def test_a_bad_request_in_a_batch_leaves_the_others_identical(micro, kind):
    model, _, tok = micro
    make, needle = _bad_jobs(model.args.vocab_size)[kind]
    good = [p for i, p in enumerate(PROMPTS) if i != 1]

    def run(with_bad):
        eng = Engine(model, tok.eos_token_ids, max_concurrency=4)
        jobs = [eng.submit(_job(p, 6)) for p in good]  # queued before start: one batch
        bad = eng.submit(make(PROMPTS[1])) if with_bad else None
        eng.start()
        try:
            out = [_collect(j) for j in jobs]
            bad_out = _collect(bad) if bad else None
            if with_bad:
                _unseeded_sample_works(eng)
        finally:
            eng.stop()
        return out, bad_out

    want, _ = run(False)
    got, (bad_tokens, bad_last) = run(True)
    assert all(isinstance(last, Finished) and toks for toks, last in want)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(isinstance(last, Finished) for _, last in got)
    assert isinstance(bad_last, Failed) and needle in bad_last.message, bad_last
    # the others' events never mention the failed request
    assert not any(isinstance(last, Failed) for _, last in got)


def test_a_bad_sampled_request_beside_sampled_ones(micro):
    """Rows sampled after the failing one in the same step (unseeded, so drawing from the
    global random state it broke) still sample; a seeded row gives its tokens unchanged."""
    model, _, tok = micro
    seeded = SamplingParams(temp=0.9, top_p=0.95, seed=11)

    def run(with_bad):
        eng = Engine(model, tok.eos_token_ids, max_concurrency=4)
        bad = (eng.submit(_job(PROMPTS[1], 6, SamplingParams(temp=1.0, top_k=model.args.vocab_size)))
               if with_bad else None)
        s = eng.submit(_job(PROMPTS[0], 6, seeded))
        u = [eng.submit(_job(p, 6, SamplingParams(temp=1.0))) for p in PROMPTS[2:]]
        eng.start()
        try:
            return _collect(s), [_collect(j) for j in u], _collect(bad) if bad else None
        finally:
            eng.stop()

    (want, _), _, _ = run(False)
    (got, last), unseeded, (_, bad_last) = run(True)
    assert isinstance(last, Finished) and got == want
    assert all(isinstance(l, Finished) and len(t) == l.generation_tokens > 0 for t, l in unseeded)
    assert isinstance(bad_last, Failed) and "top_k" in bad_last.message


def test_one_at_a_time_and_draft_engines_recover(micro):
    from kimi_mlx.speculative.loop import Speculation, load_draft

    model, wrapper, tok = micro
    spec = Speculation(load_draft(DRAFT, wrapper, MICRO), 3)
    for eng in (Engine(model, tok.eos_token_ids, max_concurrency=1),
                Engine(model, tok.eos_token_ids, max_concurrency=1, speculation=spec)):
        eng.start()
        try:
            for make, needle in _bad_jobs(model.args.vocab_size).values():
                _, last = _collect(eng.submit(make(PROMPTS[1])))
                assert isinstance(last, Failed) and needle in last.message, last
                _unseeded_sample_works(eng)
        finally:
            eng.stop()


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def servers():
    """(plain batching server, draft server): each (svc, url)."""
    out = []
    for draft, conc in ((None, 4), (DRAFT, 1)):
        svc = make_service(MICRO, None, "micro", 1 << 20)
        load_service(svc, MICRO, max_concurrency=conc, prompt_cache_bytes=32 << 20,
                     max_queue=16, max_kv_size=None,
                     drafts=DraftSettings(model=draft) if draft else None)
        out.append((svc, BackgroundServer(create_app(svc)).start()))
    yield [(svc, srv.url) for svc, srv in out]
    for svc, srv in out:
        srv.stop()
        svc.engine.stop()


BAD = [  # body fields, the field named, the range stated
    ({"top_k": 4352}, "top_k", "[0, 4352)"),
    ({"top_k": 10 ** 30}, "top_k", "[0, 4352)"),
    ({"seed": -1}, "seed", "[0, 18446744073709551616)"),
    ({"seed": 2 ** 64}, "seed", "[0, 18446744073709551616)"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "[-100, 100]"),
    ({"logit_bias": {"4352": 1}}, "logit_bias", "[0, 4352)"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "[0.01, 10]"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty", "[0.01, 10]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"temperature": 2.5}, "temperature", "[0, 2]"),
]


def _unseeded_ok(url):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "micro", "messages": MSGS, "max_tokens": 3, "temperature": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("which", [0, 1], ids=["batching", "draft"])
def test_bad_parameters_are_400s_naming_field_and_range(servers, which):
    svc, url = servers[which]
    assert n_vocab(svc) == 4352
    for fields, name, bounds in BAD:
        for stream in (False, True):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "micro", "messages": MSGS, "max_tokens": 3, "temperature": 1,
                "stream": stream, **fields})
            err = r.json()["error"]
            assert r.status_code == 400, (fields, r.text)
            assert name in err["message"] and bounds in err["message"], (fields, err)
        _unseeded_ok(url)
    for body in ({"top_k": 4352}, {"seed": -1}):
        r = httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "micro", "messages": MSGS, "max_tokens": 3, **body})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "micro", "prompt": "hi", "max_tokens": 3, **body})
        assert r.status_code == 400, r.text
    _unseeded_ok(url)


def test_the_issue_sequence_over_http(servers):
    """The issue's reproduction with the real client: top_k = vocab, then an unseeded
    temperature-1 request, on every endpoint."""
    _, url = servers[0]
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        c.chat.completions.create(model="micro", messages=MSGS, max_tokens=3, temperature=1,
                                  extra_body={"top_k": 4352})
    r = c.chat.completions.create(model="micro", messages=MSGS, max_tokens=3, temperature=1)
    assert r.usage.completion_tokens >= 1
    r = c.completions.create(model="micro", prompt="Once", max_tokens=3, temperature=1)
    assert r.usage.completion_tokens >= 1


# ------------------------------------------------------------------ streams


class _FailingEngine(BaseEngine):
    """An engine whose every job emits two tokens, then fails (as a lost stage would)."""

    queue_length = active = 0

    def submit(self, job):
        def run():
            for t in (300, 301):
                job.emit(TokenOut(t))
            job.emit(Failed("generation failed: StageFailure: stage 1 lost"))
        threading.Thread(target=run, daemon=True).start()
        return job


def _metric(url, endpoint):
    text = httpx.get(url + "/metrics", timeout=30).text
    line = f'kimi_mlx_stream_errors_total{{endpoint="{endpoint}"}} '
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(line))


def test_a_stream_failing_after_its_200_ends_with_an_error_event_counted(servers):
    real, _ = servers[0]
    svc = make_service(MICRO, None, "micro", 1 << 20)
    svc.wrapper, svc.tok, svc.context, svc.vocab_size = real.wrapper, real.tok, real.context, real.vocab_size
    svc.engine = _FailingEngine()
    srv = BackgroundServer(create_app(svc)).start()
    try:
        for path, body, ended in (
                ("/v1/chat/completions", {"messages": MSGS}, lambda t: '"error"' in t.split("data: ")[-1]),
                ("/v1/completions", {"prompt": "hi"}, lambda t: '"error"' in t.split("data: ")[-1]),
                ("/v1/messages", {"messages": MSGS}, lambda t: t.rstrip().split("\n\n")[-1].startswith("event: error"))):
            assert _metric(srv.url, path) == 0
            with httpx.stream("POST", srv.url + path, timeout=30, json={
                    "model": "micro", "max_tokens": 5, "stream": True, **body}) as s:
                text = s.read().decode()
            assert s.status_code == 200 and "stage 1 lost" in text and ended(text), text
            assert "[DONE]" not in text and "message_stop" not in text
            assert _metric(srv.url, path) == 1
            # a bad request is refused before any byte, in JSON, and not counted as a stream
            r = httpx.post(srv.url + path, timeout=30, json={
                "model": "micro", "max_tokens": 5, "stream": True, "top_k": 10 ** 6, **body})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            r = httpx.post(srv.url + path, timeout=30, json={
                "model": "other", "max_tokens": 5, "stream": True, **body})
            assert r.status_code == 404 and r.headers["content-type"] == "application/json"
            assert _metric(srv.url, path) == 1
    finally:
        srv.stop()


def test_an_internal_error_mid_stream_is_an_error_event_not_a_cut(servers, monkeypatch):
    from kimi_mlx.server.reply import ReplyBuilder

    svc, url = servers[0]
    before = _metric(url, "/v1/chat/completions")
    calls = []

    def feed(self, token):
        calls.append(token)
        if len(calls) == 2:
            raise KeyError("a bug in reply building")
        return real_feed(self, token)

    real_feed = ReplyBuilder.feed
    monkeypatch.setattr(ReplyBuilder, "feed", feed)
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "micro", "messages": MSGS, "max_tokens": 5, "stream": True}) as s:
        text = s.read().decode()
    monkeypatch.undo()
    last = json.loads(text.strip().split("\n\n")[-1][6:])
    assert s.status_code == 200 and "a bug in reply building" in last["error"]["message"]
    assert last["error"]["type"] == "server_error"
    assert _metric(url, "/v1/chat/completions") == before + 1
    _unseeded_ok(url)


# ------------------------------------------------------------------ strict schemas


ENDPOINTS = {  # path -> a minimal valid body
    "/v1/chat/completions": {"model": "micro", "messages": MSGS, "max_tokens": 2},
    "/v1/completions": {"model": "micro", "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "micro", "messages": MSGS, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "micro", "messages": MSGS},
}


def test_json_content_type_only(servers):
    _, url = servers[0]
    for path, body in ENDPOINTS.items():
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": ctype} if ctype else {}
            r = httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=60)
            assert r.status_code == 415, (path, ctype, r.text)
            assert "application/json" in r.text
        r = httpx.post(url + path, content=json.dumps(body), timeout=60,
                       headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("path,fields,name", [
    ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"temperature": "1"}, "temperature"),
    ("/v1/chat/completions", {"top_k": 5.5}, "top_k"),
    ("/v1/chat/completions", {"seed": False}, "seed"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"echo": 0}, "echo"),
    ("/v1/messages", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/messages", {"stream": 1}, "stream"),
    ("/v1/messages", {"top_k": True}, "top_k"),
])
def test_no_coercion_into_numbers_or_booleans(servers, path, fields, name):
    _, url = servers[0]
    r = httpx.post(url + path, json={**ENDPOINTS[path], **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert name in r.text


@pytest.mark.parametrize("path,tools,needle", [
    ("/v1/chat/completions", [{"type": "function"}], "tools.0.function"),
    ("/v1/chat/completions", [{"type": "web_search"}], "tools.0.type"),
    ("/v1/chat/completions", [{"type": "function", "function": {"name": ""}}], "tools.0.function.name"),
    ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools.0.function.parameters"),
    ("/v1/chat/completions", ["f"], "tools.0"),
    ("/v1/messages", [{"type": "web_search_20250305", "name": "web_search"}], "tools.0.type"),
    ("/v1/messages", [{"name": "f"}], "tools.0.input_schema"),
    ("/v1/messages/count_tokens", [{"type": "bash_20250124", "name": "bash"}], "tools.0.type"),
])
def test_tools_are_validated_and_unknown_types_refused(servers, path, tools, needle):
    _, url = servers[0]
    r = httpx.post(url + path, json={**ENDPOINTS[path], "tools": tools}, timeout=60)
    assert r.status_code == 400 and needle in r.text, r.text


def test_valid_tools_still_reach_the_prompt(servers):
    svc, url = servers[0]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fn = {"name": "weather", "description": "the weather", "parameters": schema}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        **ENDPOINTS["/v1/chat/completions"], "tools": [{"type": "function", "function": fn}]})
    assert r.status_code == 200, r.text
    want = len(encode_chat(svc.tok, MSGS, tools=[{"type": "function", "function": fn}]))
    assert r.json()["usage"]["prompt_tokens"] == want
    r = httpx.post(url + "/v1/messages/count_tokens", timeout=60, json={
        **ENDPOINTS["/v1/messages/count_tokens"], "tools": [
            {"type": "custom", "name": "weather", "description": "the weather",
             "input_schema": schema}]})
    assert r.status_code == 200 and r.json()["input_tokens"] == want


def test_deep_nesting_is_a_400(servers):
    _, url = servers[0]
    deep = "[" * 100_000 + "]" * 100_000
    for path, body in ENDPOINTS.items():
        for raw in (deep, json.dumps(body)[:-1] + ', "metadata": ' + deep + "}",
                    json.dumps(body)[:-1] + ', "x": ' + '{"a":' * 100_000 + "1" + "}" * 100_001):
            r = httpx.post(url + path, content=raw, timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and "nested" in r.text, (path, r.text[:200])
    # a deep but plausible tool schema is served
    schema = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"x": schema}}
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        **ENDPOINTS["/v1/chat/completions"],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ issue items 5-8


def test_anthropic_message_start_usage_agrees_with_message_delta(servers):
    import anthropic

    _, url = servers[0]
    c = anthropic.Anthropic(base_url=url, api_key="x", timeout=120, max_retries=0)
    msgs = [{"role": "user", "content": "Tell me about the sea. " * 6},
            {"role": "assistant", "content": "It is large and salty."},
            {"role": "user", "content": "And rivers?"}]
    usages = []
    for _ in range(2):  # the second finds the first's prompt-cache snapshots
        events = list(c.messages.create(model="micro", max_tokens=4, messages=msgs,
                                        system="Be brief.", stream=True))
        start = [e for e in events if e.type == "message_start"][0].message.usage
        delta = [e for e in events if e.type == "message_delta"][0].usage
        for field in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            assert getattr(start, field) == getattr(delta, field), (field, start, delta)
        usages.append(start)
    n_prompt = c.messages.count_tokens(model="micro", messages=msgs, system="Be brief.").input_tokens
    first, hit = usages  # (the first may reuse a preamble other tests left in the cache)
    for u in usages:
        assert u.input_tokens + u.cache_read_input_tokens == n_prompt
    # the second reads the first's snapshots; the last prompt token always runs
    assert first.cache_read_input_tokens < hit.cache_read_input_tokens < n_prompt
    # the non-streamed reply says the same
    r = c.messages.create(model="micro", max_tokens=4, messages=msgs, system="Be brief.")
    assert (r.usage.input_tokens, r.usage.cache_read_input_tokens) == (
        hit.input_tokens, hit.cache_read_input_tokens)


class _Scripted(BaseEngine):
    """Answers every job with fixed token ids."""

    queue_length = active = 0

    def __init__(self, tokens):
        self.tokens = tokens

    def submit(self, job):
        def run():
            for t in self.tokens[: job.max_tokens]:
                job.emit(TokenOut(t))
            job.emit(Finished("stop", len(job.ids), 0, len(self.tokens)))
        threading.Thread(target=run, daemon=True).start()
        return job


def test_special_tokens_are_not_reply_text(servers):
    import anthropic

    real, _ = servers[0]
    reply = ("[BOS]Let me<|close|> think[EOT].<|close|>think<|sep|><|open|>response<|sep|>"
             "Blue<|sep|>[start_header_id]<|reserved_token_4104|> it is.<|close|>response<|sep|>")
    ids = real.tok.encode(reply, allow_special=True)
    specials = set(real.tok.special_tokens.values())
    assert sum(t in specials for t in ids) > 8  # the markup and the stray ones are single ids
    svc = make_service(MICRO, None, "micro", 1 << 20)
    svc.wrapper, svc.tok, svc.context = real.wrapper, real.tok, real.context
    svc.engine = _Scripted(ids)
    srv = BackgroundServer(create_app(svc)).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        m = c.chat.completions.create(model="micro", messages=MSGS, max_tokens=100).choices[0].message
        assert (m.reasoning_content, m.content) == ("Let me think.", "Blue it is.")
        chunks = list(c.chat.completions.create(model="micro", messages=MSGS, max_tokens=100,
                                                stream=True))
        streamed = "".join((getattr(ch.choices[0].delta, "reasoning_content", None) or "")
                           + (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        assert streamed == "Let me think.Blue it is."
        text = c.completions.create(model="micro", prompt="hi", max_tokens=100).choices[0].text
        want = real.tok.decode([t for t in ids if t not in specials])
        assert text == want and "<|" not in text and "[" not in text
        a = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=60, max_retries=0)
        r = a.messages.create(model="micro", max_tokens=100, messages=MSGS)
        assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None))
                for b in r.content] == [("thinking", "Let me think."), ("text", "Blue it is.")]
        assert r.usage.output_tokens == len(ids)  # skipped tokens are still counted
    finally:
        srv.stop()


def test_max_queue_counts_only_requests_beyond_the_free_slots(micro):
    from kimi_mlx.server.jobs import Busy

    model, _, tok = micro
    eng = Engine(model, tok.eos_token_ids, max_queue=2, max_concurrency=4)  # not started
    jobs = [eng.submit(_job(PROMPTS[0], 2)) for _ in range(6)]  # 4 slots + 2 waiting
    with pytest.raises(Busy, match="2 requests are waiting"):
        eng.submit(_job(PROMPTS[0], 2))
    eng.start()
    try:
        assert all(isinstance(_collect(j)[1], Finished) for j in jobs)
    finally:
        eng.stop()


def test_a_burst_fills_every_slot_before_the_queue_refuses():
    import concurrent.futures as cf

    svc = make_service(MICRO, None, None, 1 << 20)
    load_service(svc, MICRO, max_concurrency=4, prompt_cache_bytes=0, max_queue=2,
                 max_kv_size=None)
    srv = BackgroundServer(create_app(svc)).start()
    try:
        def post(i):
            return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": "micro", "messages": MSGS, "max_tokens": 4}).status_code

        with cf.ThreadPoolExecutor(16) as ex:
            codes = list(ex.map(post, range(16)))
        assert set(codes) <= {200, 503}
        assert codes.count(200) >= 6, codes  # 4 slots + 2 waiting, at least
    finally:
        srv.stop()
        svc.engine.stop()


def test_unknown_model_404_names_the_served_id_only(servers):
    svc, url = servers[0]
    make_default = make_service(MICRO, None, None, 1 << 20)  # id from the folder's name
    assert make_default.model_ids == ["micro"]
    for model in ("gpt-9", MICRO):
        for path, body in ENDPOINTS.items():
            r = httpx.post(url + path, json={**body, "model": model}, timeout=60)
            assert r.status_code == 404, (path, model, r.text)
            assert MICRO not in r.text.replace(f"'{model}'", "") and "'micro'" in r.text
    r = httpx.get(url + "/v1/models/" + MICRO.lstrip("/"), timeout=60)
    assert r.status_code == 404 and MICRO.lstrip("/") not in r.text.replace(repr(MICRO.lstrip("/")), "")
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]] == ["micro"]


# ------------------------------------------------------------------ issue item 9


def _greedy(model, ids, n):
    """n greedy tokens recomputing the whole sequence each step: no cache, no mlx-lm."""
    out = list(ids)
    for _ in range(n):
        out.append(int(mx.argmax(model(mx.array(out)[None])[0, -1]).item()))
    return out[len(ids):]


def _completion_text(url, stream, **kw):
    body = {"model": "micro", "temperature": 0, **kw}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        return r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(l[6:]) for l in s.iter_lines()
                  if l.startswith("data: ") and l != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return text, finish, chunks[-1]["usage"]


def test_a_tail_held_back_for_a_stop_string_is_sent_at_the_end(servers):
    """Ended by length while the text's tail is a proper prefix of a stop string: the
    tail is still sent, streamed and not, equal to an independent greedy run."""
    svc, url = servers[0]
    specials = set(svc.tok.special_tokens.values())
    ids = svc.tok.encode("Once upon a time")
    ref = svc.tok.decode([t for t in _greedy(svc.engine.model, ids, 10) if t not in specials])
    stop = ref[-3:] + "\x01never"
    for stream in (False, True):
        text, finish, _ = _completion_text(url, stream, prompt="Once upon a time",
                                           max_tokens=10, stop=["\x02never", stop])
        assert (text, finish) == (ref, "length"), stream
    # ended by EOS (a scripted engine): the same for the chat channels and Anthropic
    real = svc
    reply = "Hmm.<|close|>think<|sep|><|open|>response<|sep|>Hello wor"
    fake = make_service(MICRO, None, "micro", 1 << 20)
    fake.wrapper, fake.tok, fake.context = real.wrapper, real.tok, real.context
    fake.engine = _Scripted(real.tok.encode(reply, allow_special=True))
    srv = BackgroundServer(create_app(fake)).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        kw = dict(model="micro", messages=MSGS, max_tokens=100, stop=["world"])
        r = c.chat.completions.create(**kw).choices[0]
        assert (r.message.content, r.finish_reason) == ("Hello wor", "stop")
        chunks = list(c.chat.completions.create(stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello wor"
        import anthropic

        a = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=60, max_retries=0)
        akw = dict(model="micro", max_tokens=100, messages=MSGS, stop_sequences=["world"])
        assert a.messages.create(**akw).content[-1].text == "Hello wor"
        with a.messages.stream(**akw) as s:
            assert s.get_final_message().content[-1].text == "Hello wor"
    finally:
        srv.stop()


def test_a_prompt_equal_to_a_stored_snapshot_still_runs_its_last_token(servers):
    """A request whose prompt is exactly a stored prompt-cache snapshot: the snapshot
    covering the whole prompt is not reused (its last token must run to give the first
    logits); the tokens equal a cold independent run, streamed and not."""
    from kimi_mlx.generation.request import build_chat_prompt_with_ends
    from kimi_mlx.text.chat_format import resolve_effort

    svc, url = servers[0]
    msgs = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Grass colour?"}]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "micro", "messages": msgs, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    ids, ends = build_chat_prompt_with_ends(svc.tok, msgs, resolve_effort(None), None)
    snaps = svc.engine.snapshot_points(ids, 0, ends)
    stored = [e for e in snaps if tuple(ids[:e]) in svc.engine.prompt_cache._entries]
    assert len(stored) >= 2, (snaps, stored)
    prompt = ids[:stored[-1]]  # exactly the longest stored snapshot
    specials = set(svc.tok.special_tokens.values())
    ref = svc.tok.decode([t for t in _greedy(svc.engine.model, prompt, 6) if t not in specials])
    for stream in (False, True):
        text, finish, usage = _completion_text(url, stream, prompt=prompt, max_tokens=6)
        assert text == ref, stream
        assert usage["prompt_tokens"] == len(prompt)
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < len(prompt)


@pytest.mark.parametrize("path,fields", [
    ("/v1/messages", {"tool_choice": {"type": []}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [5]}]}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": ["a"], "content": "x"}]}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": [], "name": "f", "input": {}}]}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}),
    ("/v1/messages", {"system": [{"type": "text", "text": None}]}),
    ("/v1/messages", {"system": ["x"]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "",
                                            "tool_calls": [{"id": [], "function": "x"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "",
                                            "tool_calls": [{"id": "a", "function": {"name": []}}]}]}),
])
def test_malformed_content_blocks_are_400s(servers, path, fields):
    _, url = servers[0]
    for p in (path, "/v1/messages/count_tokens") if path == "/v1/messages" else (path,):
        body = {**ENDPOINTS[p], **fields}
        r = httpx.post(url + p, json=body, timeout=60)
        assert r.status_code == 400, (p, r.text)


# ------------------------------------------------------------------ the cluster server


@pytest.fixture(scope="module")
def cluster_url(micro_pipeline):
    """`kimi-mlx cluster server` on the session's 3 pipeline stages on loopback
    (tests/fixtures/shared.py; only read here)."""
    import subprocess
    import sys
    import time

    from kimi_mlx.testing.ports import free_ports

    from kimi_mlx.lifetime import child_env
    from kimi_mlx.testing.health import wait_healthy

    cluster = micro_pipeline
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "server", "--model",
         str(cluster.ckpt), "--nodes", ",".join(p.address for p in cluster.procs),
         "--secret-file", str(cluster.secret_file), "--port", str(port),
         "--peer-timeout", "3", "--served-model-name", "micro"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_cluster_server_refuses_bad_parameters_before_admission(cluster_url):
    url = cluster_url
    greedy = {"model": "micro", "messages": MSGS, "max_tokens": 4, "temperature": 0}
    before = httpx.post(url + "/v1/chat/completions", json=greedy, timeout=120).json()
    for fields, name, bounds in BAD[:6]:
        for stream in (False, True):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                **greedy, "temperature": 1, "stream": stream, **fields})
            assert r.status_code == 400, (fields, r.text)
            assert name in r.text and bounds in r.text, (fields, r.text)
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(greedy), timeout=60,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415
    _unseeded_ok(url)
    after = httpx.post(url + "/v1/chat/completions", json=greedy, timeout=120).json()
    assert after["choices"][0]["message"] == before["choices"][0]["message"]


def test_non_finite_logprobs_are_reported_as_a_floor(servers):
    """A logits processor that rules tokens out (-inf) or a penalty overflowing float32
    (NaN) must not turn the reply into a 500 (JSON has no infinities): found by fuzzing."""
    from kimi_mlx.server.jobs import FLOOR_LOGPROB, top_logprobs

    lp = mx.array([0.0, -float("inf"), float("nan"), -1.0])
    chosen, top = top_logprobs(lp, 1, 4)
    assert chosen == FLOOR_LOGPROB and top_logprobs(lp, 3, 0) == (-1.0, [])
    assert sorted(i for i, _ in top) == [0, 1, 2, 3]
    assert dict(top)[0] == 0.0 and dict(top)[1] == dict(top)[2] == FLOOR_LOGPROB
    _, url = servers[0]
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "micro", "prompt": "Once", "max_tokens": 3, "logprobs": 2,
        "logit_bias": {str(i): -100 for i in range(20)}, "repetition_penalty": 0.01})
    assert r.status_code == 200, r.text

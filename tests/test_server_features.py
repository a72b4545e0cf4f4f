"""`kimi-mlx server` with a draft model (speculative decoding), its start-up failures, and
request validation (temperature range, NaN / Infinity, Anthropic `thinking`), driven by
the real `openai` and `anthropic` clients on the shipped micro checkpoint and its
shipped micro-draft. References: the same server without a draft, and an independent
greedy loop (whole sequence recomputed each step, no cache, no mlx-lm)."""

import threading

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest

from kimi_mlx.text.chat_format import encode_chat
from kimi_mlx.generation.request import default_model
from kimi_mlx.server.cli import main as server_main
from kimi_mlx.speculative.settings import DraftSettings
from kimi_mlx.testing.servers import start_server

MICRO = str(default_model())
DRAFT = str(default_model().parent / "micro-draft")
MSGS = [{"role": "system", "content": "You are a careful Python programmer."},
        {"role": "user", "content": "Write a queue class."}]


def _serve(draft, concurrency):
    srv, svc = start_server(MICRO, None, None, 1 << 20, max_concurrency=concurrency,
                            drafts=DraftSettings(model=draft, num_draft_tokens=3) if draft else None)
    return svc, srv


@pytest.fixture(scope="module")
def servers():
    """(plain server, speculative server): each (svc, openai client, anthropic client)."""
    out, stop = [], []
    for draft, conc in ((None, 4), (DRAFT, 1)):
        svc, srv = _serve(draft, conc)
        stop.append((svc, srv))
        out.append((svc, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120,
                                       max_retries=0),
                    anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=120,
                                        max_retries=0)))
    yield out
    for svc, srv in stop:
        srv.stop()
        svc.engine.stop()


def greedy_reference(model, ids, n):
    out = list(ids)
    for _ in range(n):
        out.append(int(mx.argmax(model(mx.array(out)[None])[0, -1]).item()))
    return out[len(ids):]


def test_speculative_server_gives_the_plain_greedy_output(servers):
    (psvc, plain, pant), (ssvc, spec, sant) = servers
    stats = ssvc.engine.speculation.stats
    steps0, accepted0 = stats.steps, stats.accepted
    kw = dict(model="micro", messages=MSGS, max_tokens=24, temperature=0, logprobs=True)
    p = plain.chat.completions.create(**kw)
    s = spec.chat.completions.create(**kw)
    ref = greedy_reference(psvc.engine.model, encode_chat(psvc.tok, MSGS), 24)
    assert p.choices[0].message.reasoning_content == psvc.tok.decode(ref)
    assert s.choices[0].message == p.choices[0].message
    for a, b in zip(s.choices[0].logprobs.content, p.choices[0].logprobs.content):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    # speculation ran and accepted drafts (the micro-draft agrees with micro often)
    assert stats.steps > steps0 and stats.accepted > accepted0
    assert stats.steps - steps0 < 24  # fewer target passes than tokens
    m = ssvc.metrics
    assert m.verify_steps._value.get() == stats.steps and m.accepted._value.get() == stats.accepted
    # a prompt-cache hit (same system prompt, another user turn) restores the draft too
    msgs = MSGS[:1] + [{"role": "user", "content": "Write a stack class."}]
    p2 = plain.chat.completions.create(**{**kw, "messages": msgs})
    s2 = spec.chat.completions.create(**{**kw, "messages": msgs})
    assert s2.usage.prompt_tokens_details.cached_tokens > 0
    assert s2.choices[0].message == p2.choices[0].message
    # streamed, completions and the Anthropic API through the same path
    chunks = spec.chat.completions.create(stream=True, **{**kw, "logprobs": False})
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
                   if c.choices) == p.choices[0].message.reasoning_content
    ckw = dict(model="micro", prompt="def __init__(self", max_tokens=16, temperature=0)
    assert spec.completions.create(**ckw).choices[0].text == \
        plain.completions.create(**ckw).choices[0].text
    akw = dict(model="micro", messages=MSGS[1:], system=MSGS[0]["content"], max_tokens=12,
               extra_body={"temperature": 0})  # this SDK has no temperature argument
    assert sant.messages.create(**akw).content == pant.messages.create(**akw).content


def test_speculative_server_sampling_and_penalties(servers):
    (_, plain, _), (ssvc, spec, _) = servers
    # seeded sampling: the same seed gives the same reply, streamed or not
    kw = dict(model="micro", messages=MSGS, max_tokens=12, temperature=0.9, seed=3)
    r = spec.chat.completions.create(**kw)
    chunks = spec.chat.completions.create(stream=True, **kw)
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
                   if c.choices) == r.choices[0].message.reasoning_content
    # penalties decode plainly (the verify step applies no logits processors): the
    # plain server's output, and a different one from the unpenalised reply
    steps = ssvc.engine.speculation.stats.steps
    pkw = dict(model="micro", prompt="the the the the", max_tokens=10, temperature=0)
    pen = dict(presence_penalty=2.0, logit_bias={"300": 3.0})
    got = spec.completions.create(**pkw, **pen).choices[0].text
    assert got == plain.completions.create(**pkw, **pen).choices[0].text
    assert got != plain.completions.create(**pkw).choices[0].text
    assert ssvc.engine.speculation.stats.steps == steps


def _main_within(argv, seconds=120):
    """server_main(argv) on a thread: its status, or a failure (not a hang) past `seconds`."""
    out = []
    t = threading.Thread(target=lambda: out.append(server_main(argv)), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"kimi-mlx server {' '.join(argv)} still running after {seconds}s"
    return out[0]


def test_a_failed_load_ends_the_server_naming_path_and_error(tmp_path, tiny_ckpt, capsys):
    """No 503 forever: `kimi-mlx server` stops with status 1 once loading fails."""
    missing = tmp_path / "no-such-model"
    assert _main_within(["--port", "0", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "listening on" in err  # it had started serving (health: loading)
    assert f"kimi-mlx server: error: loading {missing} failed" in err
    # a draft with another tokenizer (the tiny checkpoint's byte-level one) is refused at
    # start, naming both models
    assert _main_within(["--port", "0", "--draft-model", str(tiny_ckpt)]) == 1
    err = capsys.readouterr().err
    assert "does not share the tokenizer" in err and MICRO in err and str(tiny_ckpt) in err


@pytest.mark.parametrize("flags, message", [
    (["--num-draft-tokens", "2"], "--num-draft-tokens needs --draft-model"),
    (["--draft-model", DRAFT, "--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
    (["--max-kv-size", "1"], "--max-kv-size must be >= 2"),
])
def test_draft_and_context_flags_are_checked_before_loading(capsys, flags, message):
    assert server_main(["--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err


def test_temperature_range_and_non_finite_values_are_400s(servers):
    (svc, oai, ant) = servers[0]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="micro", messages=MSGS, max_tokens=2, temperature=3)
    err = e.value.body
    assert err["message"] == "temperature: must be in [0, 2], got 3"
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's own range is [0, 1]
        ant.messages.create(model="micro", messages=MSGS[1:], max_tokens=2,
                            extra_body={"temperature": 1.5})
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "temperature: must be in [0, 1], got 1.5"
    # the clients refuse to send NaN / Infinity; Python's json (and curl users) do not
    url = ant.base_url
    for path, body, needle in (
            ("/v1/chat/completions", '{"model": "micro", "messages": [{"role": "user", '
             '"content": "x"}], "temperature": NaN}', "temperature: must be a finite number in [0, 2]"),
            ("/v1/completions", '{"model": "micro", "prompt": "x", "top_p": Infinity}',
             "top_p: must be a finite number in (0, 1]"),
            ("/v1/completions", '{"model": "micro", "prompt": "x", "logit_bias": {"3": -Infinity}}',
             "logit_bias.3"),
            ("/v1/messages", '{"model": "micro", "max_tokens": 2, "messages": [{"role": "user", '
             '"content": "x"}], "temperature": NaN}', "temperature: must be a finite number in [0, 1]")):
        r = httpx.post(f"{url}{path}".replace("//v1", "/v1"), content=body,
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"]
        assert (r.json().get("type") == "error") == path.startswith("/v1/messages")


def test_anthropic_thinking_disabled_is_low_effort_without_thinking_blocks(servers):
    (svc, _, ant) = servers[0]
    kw = dict(model="micro", messages=MSGS[1:], max_tokens=6)
    on = ant.messages.create(**kw)
    assert [b.type for b in on.content] == ["thinking"]  # micro never leaves its think channel
    off = ant.messages.create(thinking={"type": "disabled"}, **kw)
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == ""
    def prompt(m):
        return m.usage.input_tokens + m.usage.cache_read_input_tokens

    assert prompt(off) == len(encode_chat(svc.tok, MSGS[1:], "low"))
    assert prompt(on) == len(encode_chat(svc.tok, MSGS[1:], "max"))
    with ant.messages.stream(thinking={"type": "disabled"}, **kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert "thinking" not in {getattr(b, "type", None) for b in final.content}
    assert final.usage.output_tokens == off.usage.output_tokens and "message_stop" in events
    with pytest.raises(anthropic.BadRequestError, match="contradicts reasoning_effort 'max'"):
        ant.messages.create(thinking={"type": "disabled"}, extra_body={"reasoning_effort": "max"},
                            **kw)
    with pytest.raises(anthropic.BadRequestError, match="enabled, adaptive, disabled"):
        ant.messages.create(thinking={"type": "sometimes"}, **kw)

"""Unknown request fields and the server's default reply cap, through `kimi-mlx server`
on micro, driven by the real `openai` and `anthropic` clients.

OpenAI's API answers a parameter it does not define with 400 "Unknown parameter: 'x'."
(param x, code unknown_parameter); the OpenAI routes here do the same, while every
parameter OpenAI documents (what the SDK, Codex, opencode, aider and the agents SDK send)
is still taken. The Anthropic route takes the beta fields Claude Code sends (its unknown
fields: tests/test_anthropic_unknown_fields.py). A
request with no budget stops at the server's --max-tokens on every route, counted by the
tokens each reply lists (chat logprobs) and its usage."""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.servers import served

KEY = "sk-test"
H = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    with served(str(default_model()), KEY, "micro", 1 << 20, max_kv_size=4096) as both:
        yield both


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, headers=H, timeout=120)


def _unknown(r, name):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == f"Unknown parameter: '{name}'.", err
    assert err["param"] == name and err["code"] == "unknown_parameter", err


def test_responses_max_tokens_is_unknown(server, oai):
    srv, _ = server
    _unknown(_post(srv, "/v1/responses", {"model": "micro", "input": "hi", "max_tokens": 8}),
             "max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="micro", input="hi", extra_body={"max_tokens": 8})
    assert "max_tokens" in str(e.value)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "micro", "messages": MSG, "max_tokens": 2}),
    ("/v1/completions", {"model": "micro", "prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"model": "micro", "input": "hi", "max_output_tokens": 2}),
])
def test_every_openai_route_names_an_unknown_field(server, path, body):
    _unknown(_post(server[0], path, {**body, "frobnicate": True}), "frobnicate")


def test_fields_real_clients_send_are_taken(server, oai):
    # the openai SDK's own parameters, as Codex / opencode / the agents SDK set them
    r = oai.chat.completions.create(
        model="micro", messages=MSG, max_completion_tokens=3, stream=False, seed=1,
        user="u", metadata={"a": "b"}, store=False, service_tier="auto", logprobs=True,
        top_logprobs=1, parallel_tool_calls=False, reasoning_effort="low",
        prompt_cache_key="k", safety_identifier="s", verbosity="low", modalities=["text"],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    chunks = list(oai.chat.completions.create(model="micro", messages=MSG, max_tokens=3,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    resp = oai.responses.create(
        model="micro", input="hi", max_output_tokens=3, store=False, include=[
            "reasoning.encrypted_content"], prompt_cache_key="k", parallel_tool_calls=False,
        reasoning={"effort": "low"}, truncation="disabled", metadata={"a": "b"},
        service_tier="auto", text={"format": {"type": "text"}},
        # Codex 0.171 sends client_metadata (its session and installation ids) on every turn
        extra_body={"client_metadata": {"x-codex-installation-id": "i", "session_id": "s"}})
    assert resp.status in ("completed", "incomplete")
    c = oai.completions.create(model="micro", prompt="hi", max_tokens=2, user="u", seed=1)
    assert c.choices[0].text is not None


def test_fields_that_would_change_the_reply_are_refused_by_name(server):
    srv, _ = server
    for name, value in (("functions", [{"name": "f"}]), ("audio", {"voice": "alloy"}),
                        ("modalities", ["text", "audio"])):
        r = _post(srv, "/v1/chat/completions", {"model": "micro", "messages": MSG, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    r = _post(srv, "/v1/responses", {"model": "micro", "input": "hi", "conversation": "c1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text


def test_anthropic_stays_lenient(server):
    srv, _ = server
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, timeout=120, max_retries=0)
    m = client.messages.create(model="micro", max_tokens=3, messages=MSG,
                               extra_body={"context_management": {"edits": []}})
    assert m.stop_reason in ("max_tokens", "end_turn")


def test_no_budget_stops_at_the_server_cap(server):
    srv, svc = server
    svc.default_max_tokens = 5
    try:
        chat = _post(srv, "/v1/chat/completions", {"model": "micro", "messages": MSG,
                                                   "logprobs": True, "temperature": 0})
        comp = _post(srv, "/v1/completions", {"model": "micro", "prompt": "The", "logprobs": 1,
                                              "temperature": 0})
        resp = _post(srv, "/v1/responses", {"model": "micro", "input": "hi", "temperature": 0})
    finally:
        svc.default_max_tokens = None
    c = chat.json()["choices"][0]
    assert c["finish_reason"] == "length" and len(c["logprobs"]["content"]) == 5, chat.text
    k = comp.json()["choices"][0]
    assert k["finish_reason"] == "length" and len(k["logprobs"]["tokens"]) == 5, comp.text
    r = resp.json()
    assert r["status"] == "incomplete" and r["usage"]["output_tokens"] == 5, resp.text


def test_help_states_the_default_cap():
    from kimi_mlx.server.serving import DEFAULT_SERVER_MAX_TOKENS

    out = subprocess.run([sys.executable, "-m", "kimi_mlx", "server", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    flat = " ".join(out.split())
    assert f"(default {DEFAULT_SERVER_MAX_TOKENS}, or the rest of the context" in flat, flat
    assert "--thinking-budget" in flat and "--max-image-pixels" in flat
    import argparse

    from kimi_mlx.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--model", "m"]).max_tokens == DEFAULT_SERVER_MAX_TOKENS

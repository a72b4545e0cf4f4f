"""Anthropic's /v1/messages and /v1/messages/count_tokens refuse an undeclared top-level
field as api.anthropic.com does: 400, error type invalid_request_error, message
"<field>: Extra inputs are not permitted" (the wording Anthropic's API answers, e.g. for
`context_management` to accounts without that beta, anthropics/claude-code#14135).
What must still pass: every top-level key of the real `anthropic` SDK's create and
count_tokens params (beta ones included: the SDK is the reference for what is
documented), and the body fields Claude Code 2.1 puts in its requests (its request
builder adds context_management, output_config, speed, diagnostics, fallbacks and,
with CLAUDE_CODE_EXTRA_BODY, anthropic_beta)."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count
from anthropic.types.beta import message_create_params as beta_create

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.schemas import CountTokensRequest, MessagesRequest
from kimi_mlx.testing.servers import served

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server():
    with served(str(default_model()), None, "micro", 1 << 20, max_kv_size=4096) as both:
        yield both[0]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", timeout=120, max_retries=0)


def _sdk_keys(*typed_dicts) -> set:
    keys = set()
    for t in typed_dicts:
        for klass in t.__mro__:
            keys |= set(getattr(klass, "__annotations__", {}))
    return keys


def test_every_field_the_sdk_documents_is_declared():
    create = _sdk_keys(message_create_params.MessageCreateParamsBase,
                       beta_create.MessageCreateParamsBase)
    count = _sdk_keys(message_count_tokens_params.MessageCountTokensParams,
                      beta_count.MessageCountTokensParams)
    assert {"model", "messages", "max_tokens", "tools", "context_management"} <= create | count
    assert create - set(MessagesRequest.model_fields) == set()
    assert count - set(CountTokensRequest.model_fields) == set()


def test_an_unknown_field_is_a_400_naming_it(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="micro", max_tokens=3, messages=MSG,
                               extra_body={"frobnicate": 1})
    assert e.value.status_code == 400
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "frobnicate: Extra inputs are not permitted"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model="micro", messages=MSG, extra_body={"max_token": 3})
    assert "max_token: Extra inputs are not permitted" in str(e.value)
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "micro", "max_tokens": 3, "messages": MSG, "stream": True, "respone_format": {}})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "respone_format: Extra inputs are not permitted"


def test_documented_and_beta_fields_are_taken(client):
    m = client.messages.create(
        model="micro", max_tokens=3, messages=MSG, system="Be brief.", stop_sequences=["\n\n"],
        metadata={"user_id": "u"}, service_tier="auto", thinking={"type": "disabled"},
        tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "auto"},
        extra_body={"temperature": 0, "top_k": 1, "inference_geo": "global"})
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")
    m = client.beta.messages.create(
        model="micro", max_tokens=3, messages=MSG, betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "low"}, speed="fast", diagnostics={"previous_message_id": None},
        cache_control={"type": "ephemeral"}, mcp_servers=[])
    assert m.stop_reason in ("max_tokens", "end_turn")
    n = client.messages.count_tokens(model="micro", messages=MSG,
                                     extra_body={"context_management": {"edits": []}})
    assert n.input_tokens > 0


def test_claude_code_body_fields_are_taken(server):
    """The keys of Claude Code 2.1.197's queryModel body, with values of its shapes."""
    r = httpx.post(server.url + "/v1/messages?beta=true", timeout=120, json={
        "model": "micro", "messages": MSG, "system": [{"type": "text", "text": "You are Claude Code."}],
        "tools": [], "metadata": {"user_id": "u"}, "max_tokens": 3,
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "temperature": 1,
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "low"}, "speed": "fast",
        "diagnostics": {"previous_message_id": None}, "fallbacks": [{"model": "micro"}],
        "anthropic_beta": ["claude-code-20250219"], "stream": True})
    assert r.status_code == 200, r.text
    assert "message_stop" in r.text

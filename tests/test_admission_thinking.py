"""Thinking budgets on every request, constrained or not, through `kimi-mlx server` on
micro: `thinking_budget` (chat completions, Responses), Anthropic's
`thinking.budget_tokens` and the server's --thinking-budget close the thinking after
that many tokens (`<|close|>think<|sep|>` forced), and the reply then goes on with its
answer.

The reference is the same request without a budget (greedy, so deterministic): with
budget N its first N tokens are the budgeted reply's thinking, token for token (chat
logprobs list every generated token, the thinking's included), and right after them come
the tokens of `<|close|>think<|sep|>` as the tokenizer encodes them."""

from __future__ import annotations

import httpx
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.servers import served
from kimi_mlx.text.chat_format import THINK_END

KEY = "sk-test"
H = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "What is 2+3? Think about it."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def server():
    with served(str(default_model()), KEY, "micro", 1 << 20, max_kv_size=4096) as both:
        yield both


def _chat(srv, max_tokens=60, **extra):
    body = {"model": "micro", "max_tokens": max_tokens, "logprobs": True,
            "messages": MESSAGES, **extra}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice, [t["token"] for t in choice["logprobs"]["content"]]


def _close_pieces(svc):
    return [svc.tok.decode([i]) for i in svc.tok.encode(THINK_END, allow_special=True)]


@pytest.fixture(scope="module")
def free(server):
    """The reply with no budget: it thinks past every budget used below."""
    srv, svc = server
    choice, tokens = _chat(srv)
    close = _close_pieces(svc)
    n = len(tokens)
    for i in range(len(tokens) - len(close) + 1):
        if tokens[i:i + len(close)] == close:
            n = i
            break
    assert n >= 20, f"micro closed its thinking after {n} tokens; the test needs more"
    return tokens


def _check_budgeted(svc, tokens, free_tokens, n, choice):
    close = _close_pieces(svc)
    assert tokens[:n] == free_tokens[:n]
    assert tokens[n:n + len(close)] == close, tokens[:n + len(close) + 2]
    # the answer follows: the reply went on after the forced close
    assert len(tokens) > n + len(close)
    assert choice["message"]["reasoning_content"] == "".join(free_tokens[:n])
    assert choice["message"]["content"]


@pytest.mark.parametrize("n", [0, 7])
def test_chat_thinking_budget_closes_the_thinking(server, free, n):
    srv, svc = server
    choice, tokens = _chat(srv, thinking_budget=n)
    if n == 0:
        close = _close_pieces(svc)
        assert tokens[:len(close)] == close and choice["message"]["content"]
        return
    _check_budgeted(svc, tokens, free, n, choice)


def test_budget_with_unforced_tools(server, free):
    # tools the model may call (trigger: the model opening a tools section) with a budget:
    # the grammar's processor holds it while the model thinks
    srv, svc = server
    choice, tokens = _chat(srv, thinking_budget=7, tools=TOOLS)
    close = _close_pieces(svc)
    i = next(k for k in range(len(tokens)) if tokens[k:k + len(close)] == close)
    assert i == 7, tokens[:12]


def test_budget_leaves_room_for_the_answer(server, free):
    # 1000 thinking tokens asked, 40 in the whole reply: the thinking gets 40 - 20 = 20
    srv, svc = server
    choice, tokens = _chat(srv, max_tokens=40, thinking_budget=1000)
    _check_budgeted(svc, tokens, free, 20, choice)


def test_server_thinking_budget(server, free):
    srv, svc = server
    svc.default_thinking_budget = 7
    try:
        choice, tokens = _chat(srv)
        _check_budgeted(svc, tokens, free, 7, choice)
        own, own_tokens = _chat(srv, thinking_budget=3)  # the request's own wins
        _check_budgeted(svc, own_tokens, free, 3, own)
    finally:
        svc.default_thinking_budget = None


def test_anthropic_budget_tokens(server, free):
    srv, svc = server
    body = {"model": "micro", "max_tokens": 60, "messages": MESSAGES,
            "thinking": {"type": "enabled", "budget_tokens": 7}}
    r = httpx.post(f"{srv.url}/v1/messages", json=body, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    text = [b["text"] for b in blocks if b["type"] == "text"]
    assert thinking == ["".join(free[:7])], blocks
    assert text and text[0], blocks


def test_responses_thinking_budget(server, free):
    srv, svc = server
    body = {"model": "micro", "max_output_tokens": 60, "input": MESSAGES, "thinking_budget": 7}
    r = httpx.post(f"{srv.url}/v1/responses", json=body, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    reasoning = [c["text"] for item in out if item["type"] == "reasoning"
                 for c in item.get("content") or []]
    text = [c["text"] for item in out if item["type"] == "message" for c in item["content"]]
    assert reasoning == ["".join(free[:7])], out
    assert text and text[0], out


def test_budget_with_ngram_drafts(free):
    # a budget alone under `--draft ngram`: the verify step masks the drafts with the
    # forced close (whose mask ends at the forced id, shorter than the vocabulary)
    from kimi_mlx.speculative.settings import DraftSettings

    with served(str(default_model()), KEY, "micro", 1 << 20, max_kv_size=4096,
                max_concurrency=1, drafts=DraftSettings(kind="ngram")) as (srv, svc):
        choice, tokens = _chat(srv, thinking_budget=7)
        _check_budgeted(svc, tokens, free, 7, choice)

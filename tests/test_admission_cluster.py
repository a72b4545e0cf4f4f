"""Thinking budgets through `kimi-mlx cluster server` (the session's 3 pipeline stages,
and a tensor group of this head and the session's tensor node, on loopback:
tests/fixtures/shared.py), the server run with --thinking-budget 5: a request with no
budget of its own thinks 5 tokens, then the forced `<|close|>think<|sep|>`, then its
answer. Reference: the same cluster's greedy reply with a larger budget of the request's
own (20 after the answer's room), whose first 5 tokens the budgeted reply's thinking must
be, token for token (chat logprobs list them)."""

import httpx
import pytest

from kimi_mlx.testing.cluster import ServerProc
from kimi_mlx.testing.ports import free_ports
from kimi_mlx.text.chat_format import THINK_END

MESSAGES = [{"role": "user", "content": "What is 2+3? Think about it."}]


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def server(request):
    # the shared stages are only read: the server's sessions end with it
    if request.param == "pipeline":
        cluster, extra = request.getfixturevalue("micro_pipeline"), ()
    else:
        cluster = request.getfixturevalue("tensor_node")
        extra = ("--parallel", "tensor", "--max-concurrency", "1")
    srv = ServerProc(cluster, free_ports(1)[0], "--thinking-budget", "5", *extra, timeout=240)
    try:
        yield srv
    finally:
        srv.stop()


def _chat(srv, **extra):
    body = {"model": "micro", "max_tokens": 40, "temperature": 0, "logprobs": True,
            "messages": MESSAGES, **extra}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=240)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice, [t["token"] for t in choice["logprobs"]["content"]]


def test_server_thinking_budget_through_the_cluster(server):
    free, free_tokens = _chat(server, thinking_budget=10_000)
    # the request's own budget, lowered to leave 40 // 2 tokens for the answer
    assert "".join(free_tokens[20:]).startswith(THINK_END), free_tokens
    choice, tokens = _chat(server)
    assert tokens[:5] == free_tokens[:5]
    assert "".join(tokens[5:]).startswith(THINK_END), tokens
    assert choice["message"]["reasoning_content"] == "".join(free_tokens[:5])
    assert choice["message"]["content"]

"""`kimi_mlx.bench.server` reads streamed replies through one `_stream`: the completion
and chat readers give the figures of a hand-written server-sent event stream (the format
of the OpenAI API: `data: {json}` lines, blank separators, `data: [DONE]` last)."""
import json

import httpx
import pytest

from kimi_mlx.bench import server as bench


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


@pytest.fixture
def served(monkeypatch):
    """Answers every POST with the events registered for its path; records the bodies."""
    routes, bodies = {}, []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        status, events = routes[request.url.path]
        return httpx.Response(status, text=_sse(events),
                              headers={"content-type": "text/event-stream"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(bench, "_client", lambda: client)
    yield routes, bodies
    client.close()


def test_completion_stream_counts_the_usage_tokens(served):
    routes, bodies = served
    routes["/v1/completions"] = (200, [
        {"choices": [{"text": ""}]},
        {"choices": [{"text": "Hel"}]},
        {"choices": [{"text": "lo"}]},
        {"choices": [], "usage": {"completion_tokens": 7}},
    ])
    n, ttft = bench._one("http://bench", "m", "hi", 16)
    assert n == 7 and ttft >= 0
    assert bodies[0]["stream"] is True and bodies[0]["max_tokens"] == 16


def test_chat_stream_joins_content_and_reasoning_and_reads_cached_tokens(served):
    routes, _ = served
    routes["/v1/chat/completions"] = (200, [
        {"choices": [{"delta": {"reasoning_content": "think"}}]},
        {"choices": [{"delta": {"content": "A"}}]},
        {"choices": [{"delta": {"content": "B"}}]},
        {"choices": [], "usage": {"prompt_tokens": 12,
                                  "prompt_tokens_details": {"cached_tokens": 8}}},
    ])
    ttft, cached, reply, n = bench._chat_ttft("http://bench", "m", [{"role": "user", "content": "q"}])
    assert (cached, n) == (8, 12)
    assert reply == {"role": "assistant", "content": "AB", "reasoning_content": "think"}


def test_an_error_status_raises(served):
    routes, _ = served
    routes["/v1/completions"] = (503, [])
    with pytest.raises(httpx.HTTPStatusError):
        bench._one("http://bench", "m", "hi", 4)

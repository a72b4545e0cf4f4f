"""A streamed /v1/messages request that waits in the queue longer than the keep-alive
interval: Anthropic's stream opens with `message_start` (the SDKs and Claude Code expect
it first), never with a `ping`; pings follow it while the wait goes on, and the reply
is the same as without the wait (its usage in message_delta)."""

import json
import threading
import time

import anthropic
import httpx
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.app import create_app
from kimi_mlx.server.engine_base import BaseEngine
from kimi_mlx.server.jobs import Finished, Started, TokenOut
from kimi_mlx.server.serving import BackgroundServer, make_service
from kimi_mlx.testing.servers import served

REPLY = "Sure.<|close|>think<|sep|><|open|>response<|sep|>Blue.<|close|>response<|sep|><|close|>message<|sep|>"


class QueuedEngine(BaseEngine):
    """Admits each job only after `wait` seconds (as a full server's queue would), then
    answers with fixed tokens; Started carries `cached` prompt-cache tokens."""

    def __init__(self, tokens, wait, cached=3):
        super().__init__()
        self.tokens, self.wait, self.cached = tokens, wait, cached

    def submit(self, job):
        def run():
            time.sleep(self.wait)
            job.emit(Started(self.cached))
            for t in self.tokens[: job.max_tokens]:
                job.emit(TokenOut(t))
            job.emit(Finished("stop", len(job.ids), self.cached, len(self.tokens)))
        threading.Thread(target=run, daemon=True).start()
        return job


@pytest.fixture(scope="module")
def real():
    with served(str(default_model()), None, None, max_concurrency=1) as both:
        yield both[1]


def _server(real, wait):
    svc = make_service("model", None, "micro", 1 << 20)
    svc.wrapper, svc.tok, svc.context = real.wrapper, real.tok, real.context
    svc.engine = QueuedEngine(real.tok.encode(REPLY, allow_special=True), wait)
    svc.keepalive_s = 0.4
    return BackgroundServer(create_app(svc)).start()


def _events(url):
    body = {"model": "micro", "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "A colour?"}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    # what keeps a waiting stream alive: pings, or empty thinking deltas once the thinking
    # block is open (Claude Code's idle watchdog skips pings)
    keepalives = sum(d.get("type") == "ping" or (
        d.get("type") == "content_block_delta" and d["delta"].get("type") == "thinking_delta"
        and d["delta"].get("thinking") == "") for d in datas)
    return names, keepalives


@pytest.mark.parametrize("wait", [0.0, 1.5])
def test_message_start_comes_first_however_long_the_queue(real, wait):
    srv = _server(real, wait)
    try:
        names, keepalives = _events(srv.url)
        assert names[0] == "message_start", names
        if wait:  # the wait (1.5 s, keep-alive every 0.4 s) is still kept alive, after message_start
            assert keepalives >= 2, names
        else:
            assert keepalives == 0, names
        assert names[-1] == "message_stop"
        c = anthropic.Anthropic(base_url=srv.url, api_key="x", timeout=60, max_retries=0)
        with c.messages.stream(model="micro", max_tokens=50,
                               messages=[{"role": "user", "content": "A colour?"}]) as s:
            m = s.get_final_message()
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == ("Sure.", "Blue.")
        assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0
        assert m.usage.cache_read_input_tokens == 3  # the admission's count, once known
    finally:
        srv.stop()

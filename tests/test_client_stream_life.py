"""How two real clients end and keep alive a stream, driven with the `anthropic` and
`openai` packages against `kimi-mlx server` on the shipped micro checkpoint.

- Claude Code resets a stream after 300 s without an event other than `ping` (its
  stream idle watchdog, CLAUDE_STREAM_IDLE_TIMEOUT_MS, never below 300 s) and retries
  without streaming. The reply's thinking block opens at admission (the K3.1
  generation prompt ends inside the think block) and, while the prompt is read, empty
  thinking deltas go out in it: events the `anthropic` SDK hands on, with no text in
  them. Checked on a scripted engine whose "prefill" is a sleep: the events' order and
  times, and the final message against the script.
- A reply cut at `max_output_tokens` ends as OpenAI documents it, with
  `response.incomplete` (status incomplete, reason max_output_tokens); the `openai`
  SDK's `responses.stream` hands that event on with the whole response. References:
  the script and the non-streamed response of the same request."""

import threading
import time

import anthropic
import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.engine_base import BaseEngine
from kimi_mlx.server.jobs import Finished, Started, TokenOut
from kimi_mlx.server.app import create_app
from kimi_mlx.server.serving import BackgroundServer, make_service
from kimi_mlx.testing.servers import served

KEY = "sk-stream-life"
MICRO = str(default_model())
REASONING, ANSWER = "Hm.", "Red."
SCRIPT = f"{REASONING}<|close|>think<|sep|><|open|>response<|sep|>{ANSWER}<|close|>response<|sep|>"
PREFILL_S, KEEPALIVE_S = 1.5, 0.2


@pytest.fixture(scope="module")
def server():
    with served(MICRO, KEY) as both:
        yield both


class _SlowPrefill(BaseEngine):
    """Admits every job at once (Started), then sleeps `delay` seconds (the prefill of a
    long prompt), then emits the scripted token ids."""

    def __init__(self, tokens, delay: float):
        super().__init__()
        self.tokens, self.delay = tokens, delay

    def submit(self, job):
        def run():
            job.emit(Started(0))
            time.sleep(self.delay)
            for t in self.tokens[: job.max_tokens]:
                job.emit(TokenOut(t))
            job.emit(Finished("stop", len(job.ids), 0, len(self.tokens)))
        threading.Thread(target=run, daemon=True).start()
        return job


def _slow_server(real):
    """Another app over `real`'s tokenizer answering through _SlowPrefill, with a short
    keep-alive period; returns the running BackgroundServer."""
    svc = make_service(MICRO, KEY, "micro", 1 << 20)
    svc.wrapper, svc.tok, svc.vocab_size = real.wrapper, real.tok, real.vocab_size
    svc.context = real.context
    svc.engine = _SlowPrefill(real.tok.encode(SCRIPT, allow_special=True), PREFILL_S)
    svc.keepalive_s = KEEPALIVE_S
    return BackgroundServer(create_app(svc)).start()


def test_thinking_block_opens_at_admission_and_lives_through_the_prefill(server):
    srv = _slow_server(server[1])
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, timeout=60, max_retries=0)
        t0 = time.monotonic()
        seen = []
        with client.messages.stream(model="micro", max_tokens=64,
                                    messages=[{"role": "user", "content": "Name a colour."}]) as s:
            for ev in s:  # the SDK's events: it drops `ping`, hands on the others
                seen.append((time.monotonic() - t0, ev))
            final = s.get_final_message()
        raw = [(t, e) for t, e in seen if e.type in (
            "message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop")]
        kinds = [e.type for _, e in raw]
        assert kinds[0] == "message_start"
        assert kinds[1] == "content_block_start" and raw[1][1].content_block.type == "thinking"
        # the thinking block is open well before the "prefill" ends ...
        assert raw[1][0] < PREFILL_S - 0.5, raw[1][0]
        # ... and events keep coming in it while the prompt is read: empty thinking deltas
        during = [(t, e) for t, e in raw if e.type == "content_block_delta"
                  and e.delta.type == "thinking_delta" and e.delta.thinking == ""]
        assert len(during) >= 3, kinds
        assert all(e.index == 0 for _, e in during)
        gaps = [b - a for a, b in zip([raw[1][0]] + [t for t, _ in during],
                                      [t for t, _ in during])]
        assert max(gaps) < 4 * KEEPALIVE_S, gaps
        # they add no text: the final message is the script's, one thinking block first
        assert [c.type for c in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == REASONING and final.content[1].text == ANSWER
        assert final.stop_reason == "end_turn"
        # and the thinking that did come was not a second block
        starts = [e for _, e in raw if e.type == "content_block_start"]
        assert [b.content_block.type for b in starts] == ["thinking", "text"]
    finally:
        srv.stop()


def test_thinking_disabled_opens_no_block_and_pings(server):
    """With thinking disabled no thinking block is opened: the prefill is covered by
    pings only (which the SDK drops), and the first block is the text."""
    srv = _slow_server(server[1])
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, timeout=60, max_retries=0)
        with client.messages.stream(model="micro", max_tokens=64,
                                    thinking={"type": "disabled"},
                                    messages=[{"role": "user", "content": "Name a colour."}]) as s:
            events = [e for e in s]
            final = s.get_final_message()
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["text"]
        assert [c.type for c in final.content] == ["text"] and final.content[0].text == ANSWER
    finally:
        srv.stop()


def test_responses_stream_cut_at_max_output_tokens_ends_incomplete(server):
    """`responses.stream` over a reply cut at max_output_tokens: the last event is
    response.incomplete with OpenAI's status and reason, the whole output and the
    usage; it equals the non-streamed response of the same request."""
    oai = openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    kw = dict(model="micro", input="Name a colour.", max_output_tokens=12, temperature=0,
              reasoning={"effort": "high"})
    plain = oai.responses.create(**kw)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        try:
            final = stream.get_final_response()
        except RuntimeError as e:  # openai <= 3.63 waits for response.completed only
            assert "response.completed" in str(e)
            final = None
    last = events[-1]
    assert last.type == "response.incomplete"
    r = last.response
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert r.output_text == text == plain.output_text
    def reasoning(resp):
        return "".join(c.text for o in resp.output if o.type == "reasoning" for c in o.content or [])

    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning(r) == streamed == reasoning(plain) and streamed
    # the same items either way (a reply cut in its reasoning has no message item, as
    # on OpenAI), the one the limit cut marked incomplete, in the stream's item.done too
    assert [o.type for o in r.output] == [o.type for o in plain.output]
    assert [o.status for o in r.output] == [o.status for o in plain.output]
    assert r.output[-1].status == "incomplete" and r.output[0].type == "reasoning"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == [o.status for o in r.output]
    if not text:
        assert [o.type for o in plain.output] == ["reasoning"]
    if final is not None:  # an SDK that returns the incomplete response
        assert final.status == "incomplete" and final.output_text == plain.output_text

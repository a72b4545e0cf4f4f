"""`kimi-mlx server --draft ngram`: greedy replies to concurrent requests equal the plain
server's, the prompt cache keeps the n-gram draft's context, flags are checked.
Reference: the same micro checkpoint served without a draft (continuous batching)."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kimi_mlx.generation.request import default_model
from kimi_mlx.server.app import create_app
from kimi_mlx.server.serving import BackgroundServer, load_service, make_service
from kimi_mlx.speculative.settings import DraftSettings

MICRO = str(default_model())
SYSTEM = {"role": "system", "content": "You are a careful Python programmer."}
ASKS = ["Write a queue class.", "def add(a, b):\n    return a + b\n\ndef add(a, b):",
        "Repeat: the cat sat on the mat, the cat sat on the mat, the cat",
        "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"]


def _serve(ngram, concurrency):
    svc = make_service(MICRO, None, None, 1 << 20)
    load_service(svc, MICRO, max_concurrency=concurrency, prompt_cache_bytes=64 << 20,
                 max_queue=8, max_kv_size=None,
                 # auto:4: k chosen per step (up to 4) by one AutoK across requests
                 drafts=DraftSettings(kind="ngram", num_draft_tokens="auto:4", ngram_max=ngram[0],
                                      ngram_min=ngram[1]) if ngram else None)
    srv = BackgroundServer(create_app(svc)).start()
    return svc, srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=120,
                                   max_retries=0)


@pytest.fixture(scope="module")
def servers():
    made = [_serve(None, 4), _serve((4, 1), 1)]
    yield made
    for svc, srv, _ in made:
        srv.stop()
        svc.engine.stop()


def _replies(client, asks, max_tokens=40):
    def one(ask):
        r = client.chat.completions.create(
            model="micro", messages=[SYSTEM, {"role": "user", "content": ask}],
            max_tokens=max_tokens, temperature=0, logprobs=True)
        return r.choices[0], r.usage

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(one, asks))


def test_four_concurrent_greedy_requests_equal_the_plain_server(servers):
    (_, _, plain), (svc, _, spec) = servers
    stats = svc.engine.speculation.stats
    want = _replies(plain, ASKS)
    got = _replies(spec, ASKS)
    for (g, _), (w, _) in zip(got, want):
        assert g.message == w.message
        for a, b in zip(g.logprobs.content, w.logprobs.content):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert stats.steps > 0 and stats.accepted > 0 and stats.plain > 0
    auto = svc.engine.speculation.num_draft_tokens
    assert auto.max_k == 4 and len(auto.ks) >= stats.steps  # --num-draft-tokens auto:4 ran
    m = svc.metrics
    assert m.verify_steps._value.get() == stats.steps
    assert m.accepted._value.get() == stats.accepted

    # the same system prompt again: a prompt-cache hit restores the n-gram context too
    again = _replies(spec, ["Write a stack class."])[0]
    assert again[1].prompt_tokens_details.cached_tokens > 0
    assert again[0].message == _replies(plain, ["Write a stack class."])[0][0].message


@pytest.mark.parametrize("flags,message", [
    (["--ngram-min", "2"], "need --draft ngram"),
    (["--draft", "ngram", "--ngram-max", "0"], "--ngram-min"),
])
def test_ngram_server_flags_are_checked_before_loading(capsys, flags, message):
    from kimi_mlx.server.cli import main

    assert main(["--port", "0"] + flags) == 2
    assert message in capsys.readouterr().err

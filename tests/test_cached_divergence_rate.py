"""The rate at which a cached second turn differs from a cache-free one, on 50 two-turn
greedy conversations cut from micro's held-out text (kimi_mlx/assets/micro/heldout),
through the one-process server's HTTP API: the session's server with a prompt cache
(turn one stores snapshots, turn two restores them: `cached_tokens` > 0) against the
session's cold server (no prompt cache: a full prefill). Compared at every reply position:
the token and the top-20 log-probabilities as floats, with == (the log-softmax of the
logits; tests/test_cached_equals_cache_free.py compares the logits themselves). Before
every prefill stopped at the snapshot points with or without a cache, 50 of 50 differed
in the low bits (README); the rate here must be 0 of 50."""

import httpx

from kimi_mlx.generation.request import default_model

N = 50


def _texts():
    folder = default_model() / "heldout"
    out = []
    for name in ("prose.txt", "code.txt"):
        text = (folder / name).read_text()
        out += [p.strip() for p in text.split("\n\n") if 80 <= len(p.strip()) <= 700]
    return out


def _chat(url, messages, n):
    r = httpx.post(url + "/v1/chat/completions", timeout=240, json={
        "model": "micro", "messages": messages, "max_tokens": n, "temperature": 0,
        "logprobs": True, "top_logprobs": 20, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["choices"][0]["message"]
    steps = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
             for e in body["choices"][0]["logprobs"]["content"]]
    reply = {"role": "assistant", "content": m.get("content") or "",
             "reasoning_content": m.get("reasoning_content") or ""}
    return reply, steps, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_second_turns_equal_cache_free_ones_on_50_conversations(micro_server, micro_cold_server):
    cached_url, cold_url = micro_server[0].url, micro_cold_server[0].url
    texts = _texts()
    assert len(texts) >= 3 * N
    differ_bits, differ_tokens = [], []
    for k in range(N):
        system, user1, user2 = texts[3 * k:3 * k + 3]
        first = [{"role": "system", "content": system}, {"role": "user", "content": user1}]
        reply, _, _ = _chat(cached_url, first, 8)  # stores turn one's snapshots
        second = first + [reply, {"role": "user", "content": "Say more about: " + user2[:200]}]
        _, got, cached = _chat(cached_url, second, 8)
        _, want, _ = _chat(cold_url, second, 8)
        assert cached > 0, f"conversation {k}: turn two restored nothing"
        if [s[0] for s in got] != [s[0] for s in want]:
            differ_tokens.append(k)
        if got != want:
            differ_bits.append(k)
    print(f"\n{N} two-turn conversations: cached second turn differs from the cache-free one "
          f"in its log-probabilities in {len(differ_bits)}, in its tokens in {len(differ_tokens)}")
    assert not differ_bits and not differ_tokens, (differ_bits, differ_tokens)

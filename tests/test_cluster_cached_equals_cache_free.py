"""A cluster's second turn restored from its prompt-cache snapshots equals a cache-free
second turn bit for bit, across processes, as one process's does
(tests/test_cached_equals_cache_free.py): the same tokens, and at every reply position
the same top-20 log-probabilities as floats (the log-softmax of the logits, compared
with ==, not within a tolerance). For a 2-stage pipeline (snapshots on the stages) and
a 2-rank tensor group (snapshots on each rank), one request at a time and in batched
rows (the default). Before, a cache-free group prefilled each prompt in one piece (one
at a time: `tensor.engine` decoded it without `open_request`; batched:
`tensor.batched.BatchHost.snapshot_points` gave no points without a cache), and the
first reply token's log-probability was -1.8939314 against the restored -1.8939309
(the tokens equal). The reference is the same cluster with
--no-prompt-cache, which has nothing to restore; the cached turn must have restored a
prefix (`cached_tokens` > 0), else nothing was compared. The prefill chunks of both
runs end at the same positions (tests/test_pipeline_prefill_stops.py,
tests/test_tensor_prefill_stops.py), so their float operations run in the same order."""

import httpx
import pytest

from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.ports import free_ports

HARD_TIMEOUT = 240
# past micro's index_topk (64) by the second turn: DSA's sparse path
SYSTEM = {"role": "system", "content": "You are a terse assistant for Python questions. " * 8}
TURNS = [["What does a for statement do?", "And a while loop?"],
         ["Name one sorting algorithm.", "Why is it fast?"]]


def _chat(url, messages, n):
    r = httpx.post(url + "/v1/chat/completions", timeout=HARD_TIMEOUT, json={
        "model": "micro", "messages": messages, "max_tokens": n, "temperature": 0,
        "logprobs": True, "top_logprobs": 20})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["choices"][0]["message"]
    steps = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
             for e in body["choices"][0]["logprobs"]["content"]]
    reply = {"role": "assistant", "content": m.get("content") or "",
             "reasoning_content": m.get("reasoning_content") or ""}
    return reply, steps, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _second_turns(url):
    """For each conversation of TURNS: (turn two's steps, its cached_tokens), turn one
    sent first (its snapshots stored, where there is a cache)."""
    out = []
    for q1, q2 in TURNS:
        messages = [SYSTEM, {"role": "user", "content": q1}]
        reply, _, _ = _chat(url, messages, 12)
        _, steps, cached = _chat(url, messages + [reply, {"role": "user", "content": q2}], 10)
        out.append((steps, cached))
    return out


def _compare(cached_run, free_run):
    for k, ((got, cached), (want, free_cached)) in enumerate(zip(cached_run, free_run)):
        assert cached > 0, f"conversation {k}: turn two restored nothing: nothing compared"
        assert free_cached == 0
        assert [s[0] for s in got] == [s[0] for s in want], f"conversation {k}: tokens differ"
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"conversation {k}, reply position {i}: {g} != {w}"


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("ceq2"), n=2, prefix="ceq", ports=free_ports(2))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_two_stage_pipeline_cached_second_turn_equals_cache_free(two_stages):
    cached = free = None
    try:
        cached = ServerProc(two_stages, free_ports(1)[0], timeout=HARD_TIMEOUT)
        free = ServerProc(two_stages, free_ports(1)[0], "--no-prompt-cache", timeout=HARD_TIMEOUT)
        _compare(_second_turns(cached.url), _second_turns(free.url))
    finally:
        for s in (cached, free):
            if s is not None:
                s.stop()


# one request at a time, and the batched rows (the server's default, --max-concurrency 4)
@pytest.mark.parametrize("rows", ["1", "4"])
def test_two_rank_tensor_group_cached_second_turn_equals_cache_free(tensor_node, rows):
    runs = []
    for extra in ((), ("--no-prompt-cache",)):  # one group at a time on the shared node
        srv = None
        try:
            srv = ServerProc(tensor_node, free_ports(1)[0], "--parallel", "tensor",
                             "--max-concurrency", rows, *extra, timeout=HARD_TIMEOUT)
            runs.append(_second_turns(srv.url))
        finally:
            if srv is not None:
                srv.stop()
    _compare(*runs)

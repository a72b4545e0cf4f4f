"""`kimi-mlx cluster server --draft-model`: the draft on the head, verify steps through 3
loopback stages (ports chosen free at run time). Greedy replies equal one process's plain greedy
replies token for token, and /metrics shows the draft was used."""

import httpx
import mlx.core as mx

from kimi_mlx.testing.cluster import ServerProc
from kimi_mlx.testing.ports import free_ports

PROMPTS = ["The for statement is used to", "class Queue:\n    def __init__(self"]


def _one_process(ckpt, prompts, n):
    from mlx_lm.generate import generate_step

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    model, _, _ = load_model(ckpt, verbose=False)
    tok = KimiTokenizer.from_pretrained(ckpt)
    return [tok.decode([t for t, _ in generate_step(mx.array(tok.encode(p)), model, max_tokens=n)])
            for p in prompts]


def _metric(text, name):
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " "))


def test_greedy_with_a_draft_through_three_stages_equals_plain(micro_pipeline):
    from kimi_mlx.generation.generate import default_model

    draft = default_model().parent / "micro-draft"
    cluster = micro_pipeline  # the session's 3 stages (tests/fixtures/shared.py), only read here
    server = None
    try:
        server = ServerProc(cluster, free_ports(1)[0], "--draft-model", str(draft), "--num-draft-tokens", "3")
        want = _one_process(cluster.ckpt, PROMPTS, 24)
        got = []
        for p in PROMPTS:
            r = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": "micro", "prompt": p, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        m = httpx.get(server.url + "/metrics", timeout=10).text
        steps = _metric(m, "kimi_mlx_speculative_verify_steps_total")
        assert steps > 0 and _metric(m, "kimi_mlx_speculative_accepted_tokens_total") > 0
        assert steps < 2 * 24  # fewer target passes than tokens: drafts were accepted
    finally:
        if server is not None:
            server.stop()


def test_a_draft_serves_one_request_at_a_time(capsys):
    from kimi_mlx.cluster.cli import main

    base = ["server", "--nodes", "127.0.0.1:44054", "--port", "0"]
    assert main(base + ["--draft-model", "x", "--max-concurrency", "2"]) == 2
    assert "--max-concurrency 1" in capsys.readouterr().err
    assert main(base + ["--num-draft-tokens", "2"]) == 2
    assert "--num-draft-tokens needs --draft-model" in capsys.readouterr().err


def test_greedy_with_ngram_drafts_through_three_stages_equals_plain(micro_pipeline):
    """`--draft ngram` (prompt lookup on the head): the same replies as plain decoding,
    with verify steps counted (a repeating prompt gives the lookup something to match)."""
    cluster = micro_pipeline
    server = None
    prompts = PROMPTS + ["for i in range(10):\n    x = i\nfor i in range(10):\n    x = i\nfor i in"]
    try:
        server = ServerProc(cluster, free_ports(1)[0], "--draft", "ngram", "--num-draft-tokens", "4")
        want = _one_process(cluster.ckpt, prompts, 24)
        got = []
        for p in prompts:
            r = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"model": "micro", "prompt": p, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        m = httpx.get(server.url + "/metrics", timeout=10).text
        assert _metric(m, "kimi_mlx_speculative_verify_steps_total") > 0
    finally:
        if server is not None:
            server.stop()

"""`kimi-mlx cluster server --parallel tensor` on loopback: this head (rank 0, the request
path) and one `cluster serve` node (rank 1), asked with the `openai` client.

- greedy completions equal `kimi-mlx generate` in one process (the independent
  reference), without and with a draft (micro-draft on rank 0, verify through the group);
- two requests at once both complete (they queue: one sequence at a time);
- a rank killed or stopped (SIGSTOP) mid-request: /health names rank and node within
  10 s, the request fails with that message, the rank process is gone.
Every process has a hard timeout; ports are free pairs chosen at run time.
"""

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kimi_mlx.testing.cluster import ServerProc
from kimi_mlx.testing.tensor_parallel import free_ports

PROMPT = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
DRAFT = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-draft"
HARD_TIMEOUT = 240


@functools.lru_cache(maxsize=None)  # greedy, so one run per (checkpoint, length) serves every test
def one_process(ckpt, max_tokens: int) -> str:
    r = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate", "--model",
                        str(ckpt), "--ignore-chat-template", "--prompt", PROMPT, "--max-tokens",
                        str(max_tokens), "--temp", "0"], capture_output=True, text=True,
                       timeout=HARD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("=" * 10)[1]  # between print_generation's ===== lines
    assert text.startswith("\n") and text.endswith("\n")
    return text[1:-1]


@pytest.fixture(scope="module")
def node(tensor_node):
    """The session's tensor node (tests/fixtures/shared.py): the tests below kill or stop
    only the ranks it starts."""
    return tensor_node


def server(node, *extra):
    (port,) = free_ports(1)
    return ServerProc(node, port, "--parallel", "tensor", "--max-concurrency", "1", *extra,
                      timeout=HARD_TIMEOUT)


def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=HARD_TIMEOUT, max_retries=0)


def rank_pids(node, after: int):
    return [int(p) for p in re.findall(r"tensor rank \d+ of \d+ .*started, pid (\d+)",
                                       node.procs[0].log_text()[after:])]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("extra", [(), ("--draft-model", str(DRAFT))], ids=["plain", "draft"])
def test_greedy_equals_one_process(node, extra):
    ref = one_process(node.ckpt, 20)
    start = len(node.procs[0].log_text())
    srv = server(node, *extra)
    try:
        deadline = time.monotonic() + 10  # the log reader thread may lag behind /health
        while "tensor-parallel group of 2" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "tensor-parallel group of 2" in srv.log_text()
        c = client(srv)
        got = c.completions.create(model="micro", prompt=PROMPT, max_tokens=20, temperature=0)
        assert got.choices[0].text == ref
        # two at once: both served (queued behind each other), both the greedy reply
        out = [None, None]

        def ask(i):
            out[i] = c.completions.create(model="micro", prompt=PROMPT, max_tokens=20,
                                          temperature=0).choices[0].text

        ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(HARD_TIMEOUT)
        assert out == [ref, ref]
        pids = rank_pids(node, start)
        assert len(pids) == 1 and alive(pids[0])
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[0])  # the server's end ends the group


DSPARK = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-dspark"
# past micro's index_topk (64): the DSA layers' sparse selection is exercised
LONG_PROMPT = " ".join([PROMPT] * 4 + ["Permission is hereby granted, free of charge, to any "
                                       "person obtaining a copy of this software"] * 3)


def test_block_drafter_greedy_equals_one_process(node):
    """A DSpark block drafter in the server: rank 0's child sends the hidden states at
    the drafter's layers back with the logits; greedy replies on a prompt past micro's
    index_topk (64) equal plain greedy in one process, twice (the second request from
    fresh drafter caches), and /metrics shows verify steps with drafts accepted."""
    import httpx

    r = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate", "--model",
                        str(node.ckpt), "--ignore-chat-template", "--prompt", LONG_PROMPT,
                        "--max-tokens", "24", "--temp", "0"], capture_output=True, text=True,
                       timeout=HARD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert int(re.search(r"Prompt: (\d+) tokens", r.stdout).group(1)) > 64
    ref = r.stdout.split("=" * 10)[1][1:-1]
    srv = server(node, "--draft-model", str(DSPARK), "--num-draft-tokens", "4")
    try:
        c = client(srv)
        for _ in range(2):
            got = c.completions.create(model="micro", prompt=LONG_PROMPT, max_tokens=24,
                                       temperature=0)
            assert got.choices[0].text == ref
        m = httpx.get(srv.url + "/metrics", timeout=10).text

        def metric(name):
            return sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith(name + " "))

        steps = metric("kimi_mlx_speculative_verify_steps_total")
        accepted = metric("kimi_mlx_speculative_accepted_tokens_total")
        print(f"tensor server, micro-dspark k=4: {steps:.0f} verify steps, "
              f"{accepted / max(steps, 1):.2f} accepted per step")
        assert steps > 0 and accepted > 0
    finally:
        srv.stop()


@pytest.mark.parametrize("sig,why", [(signal.SIGKILL, "was killed by SIGKILL"),
                                     (signal.SIGSTOP, "is stopped (SIGSTOP)")])
def test_rank_lost_while_serving(node, sig, why):
    start = len(node.procs[0].log_text())
    srv = server(node)
    try:
        pid = rank_pids(node, start)[0]
        c = client(srv)
        got: list = []
        err: list = []

        def ask():
            try:
                stream = c.completions.create(model="micro", prompt=PROMPT, max_tokens=3000,
                                              temperature=0, stream=True)
                for chunk in stream:
                    got.append(chunk.choices[0].text if chunk.choices else "")
            except Exception as e:  # the failure the client sees
                err.append(e)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        deadline = time.monotonic() + HARD_TIMEOUT
        while len(got) < 5:
            assert time.monotonic() < deadline and t.is_alive(), (err, srv.log_text()[-3000:])
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(pid, sig)
        reason = srv.wait_health(503, 10)
        detected = time.monotonic() - t0
        print(f"{sig.name}: /health 503 after {detected:.2f} s: {reason}")
        assert f"rank 1 on node {node.procs[0].node_id} {why}" in reason
        t.join(15)
        assert not t.is_alive()
        assert err, "".join(got)[-500:]  # the stream ends with an error event, naming the rank
        assert f"rank 1 on node {node.procs[0].node_id} {why}" in str(err[0])
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
        assert srv.proc.poll() is None  # the server answers on (503)
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        srv.stop()
    assert node.procs[0].alive()


def test_echo_logprobs_equal_a_forward_pass(node):
    """Scoring through the group (lm-eval's request: `[[ids]]`, echo, logprobs, max_tokens
    0 and 1) equals an independent float32 forward pass of the whole checkpoint in this
    process to 1e-4, top alternatives included."""
    import mlx.core as mx

    from kimi_mlx.checkpoint.loader import load

    model = load(node.ckpt)[0]
    ids = list(range(20, 40)) + list(range(300, 345))  # 65 tokens
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    srv = server(node)
    try:
        c = client(srv)
        for max_tokens in (0, 1):
            r = c.completions.create(model="micro", prompt=[ids], max_tokens=max_tokens,
                                     echo=True, logprobs=2, temperature=0)
            lp = r.choices[0].logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens
            assert lp.token_logprobs[0] is None
            got = lp.token_logprobs[1:len(ids)]
            diff = max(abs(a - b) for a, b in zip(got, ref))
            print(f"max |difference| to one process (max_tokens {max_tokens}): {diff:.2e}")
            assert diff < 1e-4
            for i, top in enumerate(lp.top_logprobs[1:len(ids)]):
                want = sorted(logp[i].tolist(), reverse=True)[:2]
                # distinct tokens may decode to the same text (one key, the last value)
                assert 1 <= len(top) <= 2
                assert max(min(abs(g - w) for w in want) for g in top.values()) < 1e-4
        # the generated token after scoring is the greedy one
        plain = c.completions.create(model="micro", prompt=[ids], max_tokens=1, temperature=0)
        assert lp.tokens[-1] == plain.choices[0].text
    finally:
        srv.stop()

"""`kimi-mlx cluster server` after a lost stage: /health names the loss within 10 s with
no request running, the request in flight fails (never finished on another placement),
and the server serves again when the node comes back (or, with --replan, over the nodes
left); a greedy request afterwards equals one process. Loopback stages on fixed ports
(ports chosen free at run time); every process is stopped in a `finally`."""

import signal
import time

import httpx
import mlx.core as mx
import pytest

from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.ports import free_ports

# fault and recovery runs, each with a cluster of its own: after the suite (make test-e2e)
pytestmark = pytest.mark.e2e

PROMPT = "The for statement is used to"


def _one_process(ckpt, prompt, n):
    from mlx_lm.generate import generate_step

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    model, _, _ = load_model(ckpt, verbose=False)
    tok = KimiTokenizer.from_pretrained(ckpt)
    return tok.decode([t for t, _ in generate_step(mx.array(tok.encode(prompt)), model,
                                                   max_tokens=n)])


def _complete(url, n=8):
    r = httpx.post(url + "/v1/completions", json={"model": "micro", "prompt": PROMPT,
                                                  "max_tokens": n, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _kill_while_streaming(url, stage):
    """Start a long streamed request, SIGKILL `stage` after its first token; returns the
    text streamed and whether the stream ended with an error event (or a cut stream)."""
    text, failed = [], False
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": "micro", "prompt": PROMPT, "max_tokens": 4000,
                            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        try:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                import json

                ev = json.loads(line[6:])
                if "error" in ev:
                    failed = True
                    break
                text.append(ev["choices"][0].get("text", ""))
                if len(text) == 1:
                    stage.signal(signal.SIGKILL)
                if ev["choices"][0].get("finish_reason"):
                    break
        except httpx.HTTPError:
            failed = True
    return "".join(text), failed


def test_lost_stage_is_reported_when_idle_and_served_again_after_restart(tmp_path):
    cluster = LocalCluster(tmp_path, n=3, prefix="rec", ports=free_ports(3))
    server = None
    try:
        server = ServerProc(cluster, free_ports(1)[0])
        url, err = server.url, server.log
        want = _one_process(cluster.ckpt, PROMPT, 8)
        assert _complete(url) == want

        # idle loss: nothing runs, /health still finds it (within 10 s) and names it
        cluster.procs[1].signal(signal.SIGKILL)
        cluster.procs[1].proc.wait(10)
        reason = server.wait_health(503, 10)
        assert "stage 1" in reason and "rec1" in reason, reason
        seen = []
        server.wait_health(503, 0, seen)  # still down: and it says it waits for it
        time.sleep(3)
        server.wait_health(503, 0, seen)
        assert any("waiting for it to answer again" in s for s in seen), seen
        r = httpx.post(url + "/v1/completions", json={"model": "micro", "prompt": PROMPT,
                                                      "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and "rec1" in r.text

        # the node comes back on its port with the same checkpoint: reloaded, serving again
        cluster.procs[1].start().wait_ready(60)
        server.wait_health(200, 30)
        assert _complete(url) == want
        assert any("serving again" in l and "reloading stage 1 on node rec1" in l for l in err), \
            "".join(err)[-3000:]

        # a hung stage (no heartbeats for --peer-timeout 3 s) is a loss too; when it
        # answers again, the server serves again
        cluster.procs[0].signal(signal.SIGSTOP)
        try:
            reason = server.wait_health(503, 10)
            assert "stage 0" in reason and "rec0" in reason and "heartbeat" in reason, reason
        finally:
            cluster.procs[0].signal(signal.SIGCONT)
        server.wait_health(200, 30)
        assert _complete(url) == want

        # a request in flight when a stage dies fails; it is not finished elsewhere
        text, failed = _kill_while_streaming(url, cluster.procs[2])
        assert failed, f"the stream ended without an error after {text!r}"
        assert server.wait_health(503, 10)
        cluster.procs[2].start().wait_ready(60)
        server.wait_health(200, 30)
        assert _complete(url) == want
    finally:
        if server is not None:
            server.stop()
        cluster.stop()


def test_replan_over_the_stages_left(tmp_path):
    """--replan with 4 stages: one dies (and stays dead); micro fits on the other 3, so
    the server re-plans over them and answers as one process does."""
    # slow nodes for the planner (1 MB/s of memory bandwidth, the last 1.5 MB/s): a hop
    # costs nothing next to a layer, so it plans [0, 2) [2, 3) [3, 5) [5, 6) on the four
    # and [0, 2) [2, 4) [4, 6) on three
    bw = [["--bandwidth-gbs", "0.001"]] * 3 + [["--bandwidth-gbs", "0.0015"]]
    cluster = LocalCluster(tmp_path, n=4, prefix="rp", ports=free_ports(4),
                           extras=bw)
    server = None
    try:
        server = ServerProc(cluster, free_ports(1)[0], "--replan")
        url, err = server.url, server.log
        want = _one_process(cluster.ckpt, PROMPT, 8)
        assert _complete(url) == want
        assert any("stage 3 (node rp3" in l for l in err), "".join(err)  # 4 stages planned
        cluster.procs[2].signal(signal.SIGKILL)
        cluster.procs[2].proc.wait(10)
        # the loss is named (in the log; /health's 503 can last less than its polling, as
        # a re-plan over micro's stages takes ~0.1 s), then the server serves again
        end = time.monotonic() + 10
        while not any("stage lost:" in l for l in err):
            assert time.monotonic() < end, "".join(err)[-3000:]
            time.sleep(0.05)
        reason = next(l for l in err if "stage lost:" in l)
        assert "stage 2" in reason and "rp2" in reason, reason
        server.wait_health(200, 30)
        assert _complete(url) == want
        assert any("re-planning without node rp2" in l for l in err), "".join(err)[-3000:]
        assert any(f"stage 2 (node rp3 at {cluster.procs[3].address}, layers [4, 6))" in l for l in err)
    finally:
        if server is not None:
            server.stop()
        cluster.stop()

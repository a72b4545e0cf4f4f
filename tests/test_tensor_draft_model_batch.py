"""A draft model batched through a tensor group's server (`cluster server --parallel
tensor --max-concurrency 4 --draft-model micro-draft`, 2 loopback ranks): the draft runs on
the head beside the group's rows (`speculative.proposers.DraftModelRows`), and each of four
concurrent greedy replies equals the one-process server's, one request at a time without
drafts (the independent reference)."""

import json
import threading

import pytest

from kimi_mlx.testing.tensor_parallel import free_ports

PROMPTS = [f"Request {i}: PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2 " + "word " * (3 + 9 * i)
           for i in range(4)]
N = 16


@pytest.mark.e2e  # a node, a server and a one-process reference on shared cores
def test_tensor_server_batches_draft_model_drafts_and_equals_one_process(tmp_path):
    import httpx

    from kimi_mlx.generation.request import default_model
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.servers import served

    draft = str(default_model().parent / "micro-draft")
    with served(str(default_model()), max_concurrency=1, prompt_cache_bytes=0) as (ref, _):
        want = [httpx.post(ref.url + "/v1/completions", timeout=120, json=dict(
            model="micro", prompt=p, max_tokens=N, temperature=0)).json()
            ["choices"][0]["text"] for p in PROMPTS]
    node = LocalCluster(tmp_path, n=1, prefix="tdnode", ports=[free_ports(2, consecutive=True)[0]])
    try:
        srv = ServerProc(node, free_ports(1)[0], "--parallel", "tensor", "--max-concurrency",
                         "4", "--draft-model", draft, timeout=240)
        try:
            got = [None] * 4

            def ask(i):
                r = httpx.post(srv.url + "/v1/completions", timeout=180, json=dict(
                    model="micro", prompt=PROMPTS[i], max_tokens=N, temperature=0))
                got[i] = r.json()["choices"][0]["text"]

            ts = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(200)
            assert got == want
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
            steps = [ln for ln in metrics.splitlines()
                     if ln.startswith("kimi_mlx_speculative_verify_steps_total")]
            assert steps and float(steps[0].split()[-1]) > 0
        finally:
            srv.stop()
    finally:
        node.stop()

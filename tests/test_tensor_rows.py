"""Batched decode through a tensor group (issue 33, part 2: `cluster.tensor.rows`).

- In this process (a group of one, the collectives the identity): mlx-lm's
  `BatchGenerator` over the group's stand-in rows (4 prompts of different lengths, one
  joining during the others' decode, prefill chunked) gives each prompt its one-process
  greedy tokens (`generate_step` on the plain model: the independent reference), and
  every rank-side cache is freed once the rows ended.
- 2 loopback ranks (MLX ring): the same through the group's commands, rank 1 mirroring
  every cache operation; each row equals its one-process greedy run.
- (e2e) `cluster server --parallel tensor --max-concurrency 4`: 3 requests at once and a
  4th joining during their decode, each reply equal to the one-process server's.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from kimi_mlx.testing.tensor_parallel import free_ports, run_ranks

MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"
PROMPTS = [list(range(100, 100 + n)) for n in (5, 37, 12, 70)]
N = 10


@pytest.fixture(scope="module")
def reference(micro_model):
    from mlx_lm.generate import generate_step

    model = micro_model  # the session's micro (tests/fixtures/shared.py): only read here
    refs = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=N,
                                               sampler=lambda lp: mx.argmax(lp, axis=-1))]
            for p in PROMPTS]
    return model, refs


def test_batched_rows_in_one_process_equal_single_runs_and_free_their_caches(reference):
    from kimi_mlx.cluster.tensor.rows import GroupRows
    from kimi_mlx.testing.tensor_rows import batched_greedy

    model, refs = reference
    rows = GroupRows(model, mx.distributed.init())
    # 3 at once, the 4th joins after 3 decode steps; chunks of 16 prompt tokens
    got = batched_greedy(rows, PROMPTS, N, at_once=3, join_after=3, prefill_step=16)
    assert got == refs
    rows.new_row()  # flushes the frees
    assert len(rows._local.caches) == 1


def test_batched_rows_through_two_ranks_equal_single_runs(reference, tmp_path):
    _, refs = reference
    out = tmp_path / "rows.json"
    run_ranks(free_ports(2), ["--model", str(MICRO), "--prompts", json.dumps(PROMPTS),
                              "--max-tokens", str(N), "--at-once", "3", "--join-after", "2",
                              "--out", str(out)],
              tmp_path, timeout=120, module="kimi_mlx.testing.tensor_rows")
    res = json.loads(out.read_text())
    assert res["batched"] == refs
    assert res["single"] == refs
    assert res["live_handles"] == 0


SERVER_PROMPTS = [f"Request {i}: PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2 " + "word " * (3 + 9 * i)
                  for i in range(4)]
SERVER_N = 16


@pytest.mark.e2e  # ~50 s on 2 shared cores: a node, a server and a one-process reference
@pytest.mark.parametrize("extra", [(), ("--draft", "ngram")], ids=["plain", "ngram"])
def test_server_decodes_four_requests_at_once_each_equal_to_one_process(tmp_path, extra):
    """`cluster server --parallel tensor --max-concurrency 4` with 2 loopback ranks: three
    streamed requests at once, a fourth joining once the first streams its tokens (its
    prefill between the others' decode steps); each reply equals the one-process server's
    (one request at a time, no prompt cache, no drafts). With `--draft ngram` every row's
    drafts are verified in the batch (`speculative.batch`), and /metrics counts them."""
    import threading

    import httpx

    from kimi_mlx.generation.request import default_model
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.servers import served

    with served(str(default_model()), max_concurrency=1, prompt_cache_bytes=0) as (ref, _):
        want = [httpx.post(ref.url + "/v1/completions", timeout=120, json=dict(
            model="micro", prompt=p, max_tokens=SERVER_N, temperature=0)).json()
            ["choices"][0]["text"] for p in SERVER_PROMPTS]
    node = LocalCluster(tmp_path, n=1, prefix="trnode", ports=[free_ports(2, consecutive=True)[0]])
    try:
        srv = ServerProc(node, free_ports(1)[0], "--parallel", "tensor", "--max-concurrency",
                         "4", *extra, timeout=240)
        try:
            got = [None] * 4
            streaming = threading.Event()

            def ask(i):
                text = []
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json=dict(
                        model="micro", prompt=SERVER_PROMPTS[i], max_tokens=SERVER_N,
                        temperature=0, stream=True)) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                            streaming.set()
                got[i] = "".join(text)

            ts = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for t in ts:
                t.start()
            assert streaming.wait(120)
            ts.append(threading.Thread(target=ask, args=(3,)))
            ts[-1].start()
            for t in ts:
                t.join(180)
            assert got == want
            if extra:
                metrics = httpx.get(srv.url + "/metrics", timeout=30).text
                steps = [ln for ln in metrics.splitlines()
                         if ln.startswith("kimi_mlx_speculative_verify_steps_total")]
                assert steps and float(steps[0].split()[-1]) > 0
        finally:
            srv.stop()
    finally:
        node.stop()

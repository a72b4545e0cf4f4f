"""8-bit Gated DSA caches (`--kv-bits 8`) across processes: pipeline stages (real gRPC on
loopback, the setting carried by LoadRequest) and a 2-rank tensor group (MLX ring on
127.0.0.1, the setting given to each rank) against one process with the same 8-bit
cache, which is the independent reference: one process computes every layer itself.
A stage loaded in the 8-bit format and then in the model dtype again serves the model
dtype (the format is part of what a stage holds).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.testing.checkpoints import model_tolerance, rel_err

MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"
TIMEOUT = 180.0


@pytest.fixture(scope="module")
def single():
    from kimi_mlx.checkpoint.loader import load_model

    if not MICRO.exists():
        pytest.skip("no shipped micro checkpoint")
    model, _, _ = load_model(MICRO, verbose=False)
    return model


def _prompt(n=150, seed=1):
    return np.random.default_rng(seed).integers(10, 4000, n).tolist()


def _reference(model, prompt, n, chunk, kv_bits):
    """(tokens, logprobs) of mlx-lm's generate_step in one process with the given cache."""
    from mlx_lm.generate import generate_step

    model.set_kv_quant(kv_bits)
    try:
        return [(int(t), np.array(lp)) for (t, lp), _ in zip(
            generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=chunk),
            range(n))]
    finally:
        model.set_kv_quant(None)


def test_pipeline_stages_keep_8bit_caches(micro_pipeline, single):
    """Three stages loaded with kv_bits 8: the greedy tokens and log-probabilities of one
    process with 8-bit caches, bitwise (float32 on the wire, same ops per layer); the
    same stages loaded again without it give the model-dtype process's, bitwise."""
    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.sampling import Sampling

    if micro_pipeline.ckpt.resolve() != MICRO.resolve():
        pytest.skip("the shared pipeline does not serve the micro checkpoint")
    prompt = _prompt()
    seen = {}
    for bits in (8, None):
        t, _ = micro_pipeline.load_transport(kv=(bits, 64))
        try:
            got = list(Pipeline(t, prefill_chunk=64).generate(prompt, Sampling(), 8,
                                                                   return_logprobs=True))
        finally:
            t.shutdown()
        ref = _reference(single, prompt, 8, 64, bits)
        assert [g[0] for g in got] == [r[0] for r in ref], bits
        for (_, a), (_, b) in zip(got, ref):
            assert np.array_equal(np.array(a), b), bits
        seen[bits] = np.stack([np.array(a) for _, a in got])
    assert not np.array_equal(seen[8], seen[None])  # the stages did quantize


def test_two_tensor_ranks_keep_8bit_caches(single, tmp_path):
    """2 ranks on loopback with --kv-bits 8: each rank's greedy tokens are one process's
    with 8-bit caches, logits within the tolerance rule plus one quantization step's
    worth (a rank's latent can round to the neighbouring 8-bit level), and farther from
    the model-dtype process than from the 8-bit one (the ranks did quantize)."""
    from kimi_mlx.testing.tensor_parallel import free_ports, greedy, run_ranks

    prompts = [_prompt(150, 1), _prompt(90, 2)]
    run_ranks(free_ports(2), ["--model", str(MICRO), "--prompts", json.dumps(prompts),
                              "--max-tokens", "8", "--kv-bits", "8", "--out", str(tmp_path)],
              tmp_path, timeout=TIMEOUT)
    tol = model_tolerance(single.args, 160)
    for i, p in enumerate(prompts):
        single.set_kv_quant(8)
        try:
            toks8, logits8 = greedy(single, p, 8)
        finally:
            single.set_kv_quant(None)
        toks16, logits16 = greedy(single, p, 8)
        for r in (0, 1):
            res = dict(np.load(tmp_path / f"rank{r}.npz"))
            assert res[f"tokens{i}"].tolist() == toks8.tolist(), (r, i)
            err8 = rel_err(res[f"logits{i}"], logits8)
            assert err8 < max(tol, 1e-2), (r, i, err8)
            if (toks16 == toks8).all():
                assert err8 < rel_err(res[f"logits{i}"], logits16), (r, i)


PROMPT = " ".join(["PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"] * 4
                  + ["Permission is hereby granted, free of charge, to any person obtaining "
                     "a copy of this software"] * 3)  # past micro's index_topk (64)


def _text(stdout: str) -> str:
    return stdout.split("=" * 10)[1] if stdout.count("=" * 10) >= 2 else stdout


def test_cluster_launch_tensor_with_kv_bits_equals_generate(tensor_node):
    """`cluster launch --parallel tensor --kv-bits 8` (this head rank 0, the node's rank 1
    started through StartRank with the setting) prints what `generate --kv-bits 8` prints
    in one process."""
    import subprocess
    import sys

    common = ["--model", str(tensor_node.ckpt), "--ignore-chat-template", "--prompt", PROMPT,
              "--max-tokens", "16", "--temp", "0", "--kv-bits", "8"]
    ref = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate", *common],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stderr
    r = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "launch",
                        *common, "--nodes", tensor_node.procs[0].address,
                        "--secret-file", str(tensor_node.secret_file), "--parallel", "tensor"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "ring group of 2" in r.stderr
    assert _text(r.stdout).strip() and _text(r.stdout) == _text(ref.stdout)


def test_rank_processes_get_the_cache_format(monkeypatch, tmp_path):
    """A node starts its rank with the head's --kv-bits / --kv-group-size, and refuses a
    format it does not support, naming itself."""
    import subprocess

    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.node import rank as node_rank
    from kimi_mlx.cluster.tensor.group import TensorSetupError

    seen = {}

    class Fake:
        pid = 1

        def __init__(self, argv, **kw):
            seen["argv"] = argv

    monkeypatch.setattr(subprocess, "Popen", Fake)
    import os

    rp = node_rank.RankProcess(tmp_path, 1, 2, "ring", '[["127.0.0.1:1"], ["127.0.0.1:2"]]',
                               "n1", kv=(8, 128))
    os.unlink(rp.hostfile)
    argv = seen["argv"]
    assert argv[argv.index("--kv-bits") + 1] == "8"
    assert argv[argv.index("--kv-group-size") + 1] == "128"
    with pytest.raises(TensorSetupError, match="node n1: --kv-bits 4"):
        node_rank.check_rank_request(pb.RankRequest(backend="ring", kv_bits=4), "n1")


def _conversation(url: str, turns) -> list:
    """Replies of a greedy chat replayed turn by turn (each request holds the whole
    conversation so far, as a client sends it)."""
    import httpx

    msgs, replies = [], []
    for text in turns:
        msgs.append({"role": "user", "content": text})
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "micro", "messages": msgs, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        m = r.json()["choices"][0]["message"]
        reply = (m.get("reasoning_content") or "") + (m.get("content") or "")
        msgs.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


TURNS = ["Tell me about the Python license.", "Who may copy the software?",
         "What does the warranty disclaimer say?", "Summarise the conditions in one line."]


def test_server_turns_from_the_8bit_prompt_cache_equal_cache_free_turns(tmp_path):
    """The one-process server with --kv-bits 8 and its prompt cache (memory and disk):
    a 4-turn conversation, each turn restored from the previous turns' 8-bit snapshots,
    replies as the same server without a prompt cache (every turn prefilled from
    scratch into 8-bit caches); the cache was used."""
    from kimi_mlx.testing.servers import served

    with served(str(MICRO), kv=(8, 64), prompt_cache_bytes=64 << 20,
                prompt_cache_dir=str(tmp_path)) as (srv, svc):
        cached = _conversation(srv.url, TURNS)
        pc = svc.engine.prompt_cache
        assert pc.hits >= 3
        assert pc.disk is not None and pc.disk.fingerprint.get("kv_bits") == 8
    with served(str(MICRO), kv=(8, 64), prompt_cache_bytes=0) as (srv, svc):
        fresh = _conversation(srv.url, TURNS)
    assert cached == fresh and all(r.strip() for r in fresh)

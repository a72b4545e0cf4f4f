"""The tensor group's prompt cache and images (issue 33).

- In this process (a group of one): a request restored from a rank's snapshot gives the
  logits of a cache-free forward pass over the whole prompt, and the rank cache key holds
  the token ids and the images' digests (another id or another image: no restore).
- `cluster server --parallel tensor` with 2 loopback ranks (this head rank 0, one node
  rank 1): turn 3 of a conversation restores its prefix on both ranks (cached_tokens > 0,
  Anthropic's cache_read_input_tokens too, hits in /metrics) and equals the cold
  one-process server's greedy reply; a rank that lost the snapshots makes the whole
  group prefill in full, still right (the conversation through the batched rows,
  --max-concurrency 4, the others one request at a time); an image request equals a cache-free one-process
  forward pass, and another image never shares the prefix past its pads.
- With `--prompt-cache-dir` on the node (`cluster serve`, its rank) and the server (rank
  0), the node and the server both restarted: the next turn restores from the ranks'
  disks and equals the cold one-process reply; so does the next turn after the group
  healed from a killed rank.
Every process has a hard timeout; ports are chosen free at run time.
"""

import httpx
import mlx.core as mx
import pytest

from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.tensor_parallel import free_ports

HARD_TIMEOUT = 240


def _model():
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.generation.request import default_model

    return load_model(default_model(), verbose=False)[0]


def test_restored_request_equals_a_full_forward_and_the_key_holds_ids_and_images():
    from mlx_lm.models.cache import make_prompt_cache

    from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
    from kimi_mlx.cluster.tensor.prefill import open_request
    from kimi_mlx.cluster.tensor.prompt_cache import decode_keys, encode_keys
    from kimi_mlx.server.prompt_cache import KeyedSnapshotCache

    model = _model()
    group = mx.distributed.init()  # a group of one: the collectives are the identity
    ids = list(range(100, 160))
    pad = 7
    key = ids[:10] + [(pad, "aa" * 16)] + ids[11:]  # an "image" pad at position 10
    keys = list(HeadCacheIndex(every=16).plan(key, 0, [20]).values())
    assert decode_keys(encode_keys(keys)) == keys  # as the commands carry them

    def run(key, index, store):
        target = open_request(model, group, ids, key=key, index=index, store=store,
                              segment_ends=[20])
        logits = target(mx.array(ids[-1:])[None])
        target.end()
        return target.cached, logits[0, -1]

    index, store = HeadCacheIndex(every=16), KeyedSnapshotCache(1 << 30)
    cached, first = run(key, index, store)
    assert cached == 0 and len(store) == 4  # snapshots at 16, 20, 32, 48
    cached, again = run(key, index, store)
    assert cached == 48
    ref = model(mx.array(ids)[None], cache=make_prompt_cache(model))[0, -1]
    assert mx.allclose(again, ref, atol=1e-4).item() and mx.allclose(first, ref, atol=1e-4).item()
    # another image at position 10: nothing past it is shared (the digest is in the key)
    other = key[:10] + [(pad, "bb" * 16)] + key[11:]
    assert run(other, index, store)[0] == 0
    # another token id at position 30: only the prefixes before it
    ids_key = key[:30] + [999] + key[31:]
    assert run(ids_key, index, store)[0] == 20
    # a rank whose store lost the snapshot: the group prefills in full, still right
    store.clear()
    cached, cold = run(key, index, store)
    assert cached == 0 and mx.allclose(cold, ref, atol=1e-4).item()


@pytest.fixture(scope="module")
def one_process(micro_cold_server):
    """`kimi-mlx server` in this process without a prompt cache: the cold reference (the
    session's, tests/fixtures/shared.py)."""
    return micro_cold_server[0].url


def _node(tmp_path_factory, name, ckpt=None, extra=()):
    grpc_port, _ = free_ports(2, consecutive=True)
    return LocalCluster(tmp_path_factory.mktemp(name), n=1, prefix=name, ports=[grpc_port],
                        ckpt=ckpt, extra=list(extra))


def _server(node, *extra):
    (port,) = free_ports(1)
    return ServerProc(node, port, "--parallel", "tensor", "--max-concurrency", "1", *extra,
                      timeout=HARD_TIMEOUT)


def _chat(url, messages, n=10):
    r = httpx.post(url + "/v1/chat/completions", timeout=HARD_TIMEOUT,
                   json={"model": "micro", "messages": messages, "max_tokens": n,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["choices"][0]["message"]
    return (m.get("content") or "", m.get("reasoning_content") or ""), body["usage"]


def _lookups(url):
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kimi_mlx_cluster_prompt_cache_lookups_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


SYSTEM = {"role": "system", "content": "You are a terse assistant for Python questions. " * 3}
QUESTIONS = ["What does a for statement do?", "And a while loop?", "How do I stop one early?"]


def test_turn_three_is_cached_on_both_ranks_and_equals_one_process(tensor_node, one_process):
    node = tensor_node  # the session's (tests/fixtures/shared.py): each server starts its own ranks
    srv = None
    try:
        # the batched rows (the default: `tensor.batched`): each row restores and snapshots
        srv = _server(node, "--max-concurrency", "4")
        messages = [SYSTEM]
        for turn, q in enumerate(QUESTIONS):
            messages = messages + [{"role": "user", "content": q}]
            got, usage = _chat(srv.url, messages)
            want, ref_usage = _chat(one_process, messages)
            assert got == want, f"turn {turn + 1}"
            assert usage["prompt_tokens"] == ref_usage["prompt_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (cached == 0) if turn == 0 else (0 < cached < usage["prompt_tokens"])
            messages = messages + [{"role": "assistant", "content": got[0],
                                    "reasoning_content": got[1]}]
        # the same conversation through Anthropic's API: its prefix is read from the cache
        r = httpx.post(srv.url + "/v1/messages", timeout=HARD_TIMEOUT, json={
            "model": "micro", "max_tokens": 5, "temperature": 0, "system": SYSTEM["content"],
            "messages": [{"role": "user", "content": QUESTIONS[0]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["cache_read_input_tokens"] > 0
        seen = _lookups(srv.url)
        assert seen.get("hit", 0) >= 2 and seen.get("miss", 0) >= 1, seen
    finally:
        if srv is not None:
            srv.stop()


@pytest.mark.e2e  # a degraded-cache run on a node of its own (--cache-bytes 1): make test-e2e
def test_a_rank_without_the_snapshot_means_a_full_prefill_on_every_rank(tmp_path_factory,
                                                                        one_process):
    """The node's rank keeps no snapshot (`cluster serve --cache-bytes 1`) while rank 0
    keeps them all: the group agrees on a full prefill (cached_tokens 0, counted as a
    miss) and the reply is still the one-process reply (a rank 0 that restored alone
    would decode from states rank 1 does not have)."""
    node = _node(tmp_path_factory, "tmnode", extra=["--cache-bytes", "1"])
    srv = None
    try:
        srv = _server(node)
        messages = [SYSTEM]
        for turn, q in enumerate(QUESTIONS[:2]):
            messages = messages + [{"role": "user", "content": q}]
            got, usage = _chat(srv.url, messages)
            assert got == _chat(one_process, messages)[0], f"turn {turn + 1}"
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            messages = messages + [{"role": "assistant", "content": got[0],
                                    "reasoning_content": got[1]}]
        seen = _lookups(srv.url)
        assert seen.get("miss", 0) == 2 and not seen.get("hit") and not seen.get("shorter")
    finally:
        if srv is not None:
            srv.stop()
        node.stop()


@pytest.mark.e2e  # a node, a tensor server, generate and a one-process reference: ~25 s alone; after the suite
def test_image_request_equals_one_process_and_generate(tmp_path_factory, tmp_path):
    """micro-vision (it names a picture's colour and shape) through 2 ranks: the greedy
    tokens of a cache-free one-process forward pass and the text of `kimi-mlx generate
    --image`, from the server and from `cluster launch --parallel tensor --image`; the
    second picture shares no cached prefix past its first pad."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    import openai

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.generation.images import Vision
    from kimi_mlx.generation.request import build_chat_prompt_with_ends
    from kimi_mlx.micro.vision_train import draw
    from kimi_mlx.text.tokenizer import KimiTokenizer
    from test_server_images import data_url, greedy_reference

    ckpt = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-vision"
    paths = {}
    for name, shape, colour, seed in (("a", "circle", "red", 1), ("b", "square", "blue", 2)):
        paths[name] = tmp_path / f"{name}.png"
        draw(shape, colour, np.random.default_rng(seed)).save(paths[name])
    raw = {k: p.read_bytes() for k, p in paths.items()}
    question, n = "What is in the image?", 14
    node = _node(tmp_path_factory, "tvnode", ckpt)
    srv = None
    try:
        srv = _server(node)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=HARD_TIMEOUT,
                          max_retries=0)

        def msgs(part):
            return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]

        def ask(k):
            return c.chat.completions.create(
                model="micro", max_tokens=n, temperature=0, logprobs=True,
                messages=msgs({"type": "image_url", "image_url": {"url": data_url(raw[k])}}))

        ra, rb, ra2 = ask("a"), ask("b"), ask("a")
        # the tower (on the server, for rank 0) ran once per image
        assert "kimi_mlx_vision_tower_runs_total 2.0" in httpx.get(
            srv.url + "/metrics", timeout=10).text.splitlines()
        srv.stop()
        srv = None
        launch = subprocess.run(  # `cluster launch --parallel tensor --image` too
            [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "launch", "--parallel",
             "tensor", "--nodes", node.procs[0].address, "--secret-file",
             str(node.secret_file), "--model", str(ckpt), "--image", str(paths["a"]),
             "--prompt", question, "--temp", "0", "--max-tokens", str(n)],
            capture_output=True, text=True, timeout=HARD_TIMEOUT)
        assert launch.returncode == 0, launch.stderr
    finally:
        if srv is not None:
            srv.stop()
        node.stop()
    model = load_model(ckpt, verbose=False)[0]
    tok = KimiTokenizer.from_pretrained(ckpt)
    vision = Vision(ckpt)
    pad = tok.special_tokens["<|media_pad|>"]
    got = {}
    for k, r in (("a", ra), ("b", rb)):
        im = vision.load_image(raw[k])
        ids, _ = build_chat_prompt_with_ends(tok, msgs({"type": "image", "media": im}), "max")
        want = greedy_reference(model, vision, pad, ids, [im], n, set(tok.eos_token_ids))
        assert r.usage.prompt_tokens == len(ids)
        assert [bytes(e.bytes) for e in r.choices[0].logprobs.content] == \
            [tok.decode_bytes([t]) for t in want]
        got[k] = want
        gen = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate",
                              "--model", str(ckpt), "--image", str(paths[k]), "--prompt",
                              question, "--temp", "0", "--max-tokens", str(n)],
                             capture_output=True, text=True, timeout=HARD_TIMEOUT)
        assert gen.returncode == 0, gen.stderr
        assert f"Prompt: {len(ids)} tokens" in gen.stdout
        assert gen.stdout.split("=" * 10)[1].strip() == r.choices[0].message.content.strip()
        if k == "a":
            assert launch.stdout.split("=" * 10)[1] == gen.stdout.split("=" * 10)[1]
    first_pad = ids.index(pad)
    assert got["a"] != got["b"]  # the picture matters
    assert rb.usage.prompt_tokens_details.cached_tokens <= first_pad
    assert ra2.usage.prompt_tokens_details.cached_tokens > first_pad
    assert [e.bytes for e in ra2.choices[0].logprobs.content] == \
        [e.bytes for e in ra.choices[0].logprobs.content]


def _indexed(folder):
    """Snapshot entries in each fingerprint subfolder's index.json."""
    import json

    return {p.parent.name: len(json.loads(p.read_text())["entries"])
            for p in folder.glob("*/index.json")}


def _first_turn_on_both_disks(url, first, head_dir, node_dir):
    """Run the conversation's first turn (nothing cached yet) and wait until both ranks'
    background writers have indexed its snapshots; returns the reply."""
    import time

    reply, usage = _chat(url, first)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    end = time.monotonic() + 30  # both ranks write in the background
    while not (_indexed(head_dir) and _indexed(node_dir)
               and all(_indexed(head_dir).values()) and all(_indexed(node_dir).values())):
        assert time.monotonic() < end, (_indexed(head_dir), _indexed(node_dir))
        time.sleep(0.1)
    return reply


@pytest.mark.e2e  # two tensor groups in turn: ~15 s alone; after the suite
def test_ranks_restarted_restore_from_their_disks(tmp_path_factory, tmp_path, one_process):
    import signal

    head_dir, node_dir = tmp_path / "head-pc", tmp_path / "node-pc"
    node = _node(tmp_path_factory, "tdnode", extra=["--prompt-cache-dir", str(node_dir)])
    srv = None
    try:
        srv = _server(node, "--prompt-cache-dir", str(head_dir))
        first = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        reply = _first_turn_on_both_disks(srv.url, first, head_dir, node_dir)
        srv.stop()
        srv = None
        for p in node.procs:  # the node (and so its rank) killed, then started again
            p.signal(signal.SIGKILL)
            p.proc.wait(10)
            p.start()
            p.wait_ready(60)
        srv = _server(node, "--prompt-cache-dir", str(head_dir))
        second = first + [{"role": "assistant", "content": reply[0], "reasoning_content": reply[1]},
                          {"role": "user", "content": QUESTIONS[1]}]
        got, usage = _chat(srv.url, second)
        want, _ = _chat(one_process, second)
        assert got == want
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        assert _lookups(srv.url).get("disk") == 1.0
    finally:
        if srv is not None:
            srv.stop()
        node.stop()


@pytest.mark.e2e  # a heal run (as test_cluster_tensor_heal): after the suite
def test_a_healed_group_restores_from_the_disks_its_dead_ranks_wrote(tmp_path_factory,
                                                                     tmp_path, one_process):
    """The node's rank killed after a turn whose snapshots both ranks wrote to disk: the
    server forms the group again (a new rank 0 process with an empty memory store, a new
    node rank), and the next turn restores from the folders the dead ranks used (their
    locks went with them) and equals the cold one-process reply."""
    import os
    import signal

    from test_cluster_tensor_heal import node_rank, server_rank0

    head_dir, node_dir = tmp_path / "head-pc", tmp_path / "node-pc"
    node = _node(tmp_path_factory, "thnode", extra=["--prompt-cache-dir", str(node_dir)])
    srv = None
    try:
        srv = _server(node, "--prompt-cache-dir", str(head_dir))
        first = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        reply = _first_turn_on_both_disks(srv.url, first, head_dir, node_dir)
        old_rank0 = server_rank0(srv)
        os.kill(node_rank(node), signal.SIGKILL)
        assert "was killed by SIGKILL" in srv.wait_health(503, 20)
        srv.wait_health(200, 60)
        assert server_rank0(srv) != old_rank0
        second = first + [{"role": "assistant", "content": reply[0], "reasoning_content": reply[1]},
                          {"role": "user", "content": QUESTIONS[1]}]
        got, usage = _chat(srv.url, second)
        want, _ = _chat(one_process, second)
        assert got == want
        assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    finally:
        if srv is not None:
            srv.stop()
        node.stop()


def test_rank_disk_folders_are_named_by_rank_and_group_size(tmp_path):
    """A snapshot a rank wrote is read back by the same rank of a group of the same size
    only: another rank or group size holds other slices (`rank_fingerprint`)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kimi_mlx.cluster.net.cache_keys import prefix_key
    from kimi_mlx.cluster.tensor.prompt_cache import make_store, rank_fingerprint
    from kimi_mlx.generation.request import default_model

    model = _model()
    ids = list(range(100, 120))
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    key = prefix_key(ids)

    def store(rank, size):
        fp = rank_fingerprint(default_model(), model, rank, size)
        return make_store(1 << 30, tmp_path, 1 << 30, fp)

    s = store(0, 2)
    assert s.store(key, len(ids), cache)
    s.attach_disk(None)  # written and closed
    for rank, size, held in [(0, 2, True), (1, 2, False), (0, 4, False)]:
        s = store(rank, size)
        assert bool(s.held([key])) is held, (rank, size)
        s.attach_disk(None)

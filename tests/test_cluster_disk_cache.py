"""The stages' prompt cache on disk (`cluster serve --prompt-cache-dir`): 3 loopback stages
sharing one folder (a subfolder per layer range), every stage killed and restarted between
two turns; the second turn restores from the stages' disks and equals a cache-free
one-process server's reply. And the stage fingerprint's parts each name another folder."""

import dataclasses
import json
import signal
import time

import httpx
import pytest

from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.ports import free_ports

SYSTEM = {"role": "system", "content": "You answer questions about Python's standard "
          "library, briefly and with one example each. " * 6}


def chat(url, messages, n=8):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "micro", "messages": messages, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["choices"][0]["message"]
    return (m.get("content") or "", m.get("reasoning_content") or ""), body["usage"]


def indexed(folder):
    """Snapshot entries in each subfolder's index.json (one subfolder per stage)."""
    out = {}
    for idx in folder.glob("*/index.json"):
        out[idx.parent.name] = len(json.loads(idx.read_text())["entries"])
    return out


@pytest.mark.e2e  # a recovery run (stages and head restarted) on a cluster of its own: make test-e2e
def test_stages_restarted_restore_from_their_disks(tmp_path, micro_cold_server):
    folder = tmp_path / "pc"
    flags = ["--prompt-cache-dir", str(folder), "--prompt-cache-disk-bytes", "1GB"]
    cluster = LocalCluster(tmp_path, n=3, prefix="dk", ports=free_ports(3), extra=flags)
    server = None
    try:
        server = ServerProc(cluster, free_ports(1)[0])
        first = [SYSTEM, {"role": "user", "content": "What is functools.partial?"}]
        reply, usage = chat(server.url, first)
        assert usage["prompt_tokens"] > 150
        end = time.monotonic() + 30  # the stages' writers work in the background
        while not (len(indexed(folder)) == 3 and all(indexed(folder).values())):
            assert time.monotonic() < end, indexed(folder)
            time.sleep(0.1)
        server.stop()  # the head too: it remembers no prefix now, the stages' disks do
        for p in cluster.procs:
            p.signal(signal.SIGKILL)
        for p in cluster.procs:
            p.proc.wait(10)
        for p in cluster.procs:
            p.start()
        for p in cluster.procs:
            p.wait_ready(60)
        server = ServerProc(cluster, free_ports(1)[0])
        second = first + [{"role": "assistant", "content": reply[0], "reasoning_content": reply[1]},
                          {"role": "user", "content": "And functools.reduce?"}]
        got, usage = chat(server.url, second)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 150  # from the disks
        chat(server.url, second, 1)  # one more lookup: the stages report their reads
        hits, lookups = {}, {}
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kimi_mlx_cluster_stage_prompt_cache_disk_hits_total{"):
                hits[line.split('"')[1]] = float(line.split()[-1])
            if line.startswith("kimi_mlx_cluster_prompt_cache_lookups_total{"):
                lookups[line.split('"')[1]] = float(line.split()[-1])
        assert hits == {"0": 1.0, "1": 1.0, "2": 1.0}
        assert lookups == {"disk": 1.0, "hit": 1.0}  # the restarted head's first, then remembered
    finally:
        if server is not None:
            server.stop()
        cluster.stop()
    ref, _ = micro_cold_server  # the session's cache-free server (tests/fixtures/shared.py)
    assert got == chat(ref.url, second)[0]


def test_the_heads_policy_keys_are_the_stages_keys():
    """A restarted head asks for the policy's prefixes by `server.disk_cache.prefix_keys`
    (one pass); the stages stored them under `net.cache_keys.prefix_key`: the same key
    for every prefix, with and without images."""
    from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
    from kimi_mlx.cluster.net.cache_keys import prefix_key

    ids = [5 + i % 97 for i in range(3000)]
    ids[40:44] = [(9, "ab" * 32)] * 4
    cands = HeadCacheIndex(every=1024).policy_candidates(ids, [30, 700])
    assert [n for n, _ in cands] == [2048, 1024, 700, 30]
    assert all(key == prefix_key(ids[:n]) for n, key in cands)


def test_stage_fingerprint_names_checkpoint_layers_and_dtype(tmp_path):
    from kimi_mlx.cluster.node.runner import StageSpec
    from kimi_mlx.cluster.node.stage_cache import stage_fingerprint
    from kimi_mlx.server.disk_cache import DiskSnapshotStore

    spec = StageSpec("f" * 24, 0, 2, 0, 2, "float32", "float32")
    ids = set()
    for change, files in (({}, "a"), ({"fingerprint": "e" * 24}, "a"), ({"start": 1}, "a"),
                          ({"end": 3}, "a"), ({"compute_dtype": "bfloat16"}, "a"), ({}, "b")):
        fp = stage_fingerprint(dataclasses.replace(spec, **change), files)
        d = DiskSnapshotStore(tmp_path, 1 << 20, fp)
        ids.add(d.fp_id)
        d.close()
    assert len(ids) == 6
    # the stage index and the wire dtype do not change what a snapshot holds
    same = dataclasses.replace(spec, index=1, num_stages=3, wire_dtype="bfloat16")
    assert stage_fingerprint(same) == stage_fingerprint(spec)

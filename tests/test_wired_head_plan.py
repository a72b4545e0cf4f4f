"""Stages and tensor ranks wire memory for the caches the head plans, not the trained context.

`kimi-mlx cluster server --max-kv-size N --max-concurrency S` plans every stage (and every
rank of a tensor group) for N tokens x S sequences; each of those processes, on a faked
Mac (`kimi_mlx.testing.fake_metal`), must set MLX's wired limit to its weights plus the
caches of N tokens x S sequences. The expected limit is worked out here independently:
weight bytes from the safetensors headers / the loader's own byte count of a rank's
slices, caches per token and per sequence by hand from config.json (`test_wired.
cache_by_hand`, K31_SPEC.md section 4), times N and S.
"""

from __future__ import annotations

import pytest

from kimi_mlx.testing import fake_metal

from test_wired import (MAC64, MICRO, _Group, _wait_records, cache_by_hand, layer_weight_bytes,
                        text_config)

pytestmark = pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")


def _fake_env(monkeypatch, rec):
    """The fake device for this test's child processes: the head server's environment
    (the rank 0 child it starts inherits it), restored after the test."""
    for k, v in fake_metal.env(MAC64, rec, base={}).items():
        monkeypatch.setenv(k, v)


def _health(cluster, i):
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
    from kimi_mlx.cluster.net.channel import make_channel

    ch = make_channel(cluster.procs[i].address, cluster.secret)
    try:
        return pb_grpc.StageStub(ch).Health(pb.HealthRequest(), timeout=10)
    finally:
        ch.close()


@pytest.mark.timeout(600)
def test_pipeline_stages_wire_for_the_heads_context_and_concurrency(tmp_path, monkeypatch):
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.ports import free_ports

    tokens, sequences = 1024, 3  # the trained context is 4096, the default concurrency 4
    assert text_config(MICRO)["max_position_embeddings"] != tokens
    rec = tmp_path / "calls.jsonl"
    cluster = LocalCluster(tmp_path, n=2, ckpt=MICRO, env=fake_metal.env(MAC64, rec, base={}))
    try:
        srv = ServerProc(cluster, free_ports(1)[0], "--max-kv-size", str(tokens),
                         "--max-concurrency", str(sequences), timeout=300)
        try:
            stage_pids = {p.proc.pid for p in cluster.procs}
            calls = _wait_records(rec, lambda r: {c["pid"] for c in r} >= stage_pids,
                                  loaded=lambda: True)
            ranges = [(h.start, h.end) for h in (_health(cluster, i) for i in range(2))]
        finally:
            srv.stop()
    finally:
        cluster.stop()
    n = text_config(MICRO)["num_hidden_layers"]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == n, ranges
    by_pid = {c["pid"]: c["limit"] for c in calls if c["limit"]}  # not the restores at exit
    for proc, (start, end) in zip(cluster.procs, ranges):
        want = (layer_weight_bytes(MICRO, start, end, n)
                + cache_by_hand(MICRO, tokens, sequences, layers=range(start, end)))
        assert by_pid[proc.proc.pid] == want, ((start, end), want, calls)


@pytest.mark.timeout(600)
def test_tensor_ranks_wire_for_the_heads_context_and_concurrency(tmp_path, monkeypatch):
    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.testing.cluster import LocalCluster, ServerProc
    from kimi_mlx.testing.ports import free_ports

    tokens, sequences = 512, 2  # batched: the group decodes 2 rows together
    rec = tmp_path / "calls.jsonl"
    grpc_port, _ = free_ports(2, consecutive=True)  # the node's rank listens on port + 1
    cluster = LocalCluster(tmp_path, n=1, ckpt=MICRO, ports=[grpc_port],
                           env=fake_metal.env(MAC64, rec, base={}))
    try:
        _fake_env(monkeypatch, rec)  # the server's rank 0 child
        srv = ServerProc(cluster, free_ports(1)[0], "--parallel", "tensor", "--max-kv-size",
                         str(tokens), "--max-concurrency", str(sequences), timeout=300)
        try:
            def kind(c):
                return ("rank 0" if "relay" in c["argv"][0]
                        else "rank 1" if c["argv"][0].endswith("rank.py") else None)

            calls = _wait_records(rec, lambda r: {kind(c) for c in r} >= {"rank 0", "rank 1"},
                                  timeout=300)
        finally:
            srv.stop()
    finally:
        cluster.stop()
    by_rank = {kind(c): c["limit"] for c in calls if c["limit"] and kind(c)}
    for r in (0, 1):
        _, stats = load_sharded(MICRO, _Group(2, r))  # the bytes of its slices, as read
        # each rank holds half of every KDA layer's heads' state, the attention caches whole
        want = stats["needed"] + cache_by_hand(MICRO, tokens, sequences, kda_share=0.5)
        assert by_rank[f"rank {r}"] == want, (r, want, calls)

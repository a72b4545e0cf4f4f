"""MLX's wired limit counts `--kv-bits 8` caches in their 8-bit bytes, not BF16.

Each process runs on its own on a faked Mac (`kimi_mlx.testing.fake_metal`, which records
every `set_wired_limit`): `kimi-mlx generate --kv-bits 8`, a `cluster serve` stage loaded
with an 8-bit cache (LoadRequest kv_bits) and a tensor rank started as
`python -m kimi_mlx.cluster.tensor.rank --kv-bits 8`. The expected limit is worked out
here independently: weight bytes from the files / headers / the loader's byte count of a
rank's slices (as test_wired), and the cache per token by hand from config.json with
each quantized vector's bytes taken from MLX itself (`mx.quantize` of one token's latent
and index key: packed values plus a scale and a bias per group, the group being the
vector itself when it is shorter than --kv-group-size, as model/cache.py stores it); the
64-value rope key stays BF16. Each test also checks that the figure differs from the
BF16 count, which the processes wired before they counted the cache format.
"""

from __future__ import annotations

import subprocess

import pytest

from kimi_mlx.testing import fake_metal

from test_wired import (MAC64, MICRO, PY, _Group, _kill, _run, _wait_records, cache_by_hand,
                        file_weight_bytes, layer_weight_bytes, text_config)

pytestmark = pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")


def quantized_bytes(values: int, group_size: int, bits: int = 8) -> int:
    """Bytes MLX's affine format keeps for one `values`-long BF16 vector (packed words,
    scales and biases), measured on `mx.quantize` itself."""
    import mlx.core as mx

    group = min(group_size, values)
    w, s, b = mx.quantize(mx.ones((1, values), dtype=mx.bfloat16), group_size=group, bits=bits)
    return w.nbytes + s.nbytes + b.nbytes


def cache_by_hand_8bit(folder, tokens: int, sequences: int = 1, layers=None,
                       kda_share: float = 1.0, group_size: int = 64) -> int:
    """`test_wired.cache_by_hand` with the attention layers' latent and index key in 8
    bits (`quantized_bytes`) and the rope key in BF16; KDA states as they are."""
    return cache_by_hand(folder, tokens, sequences, layers, kda_share,
                         vector_bytes=lambda values: quantized_bytes(values, group_size))


def test_hand_count_is_smaller_than_bf16():
    """The figure the tests below hold the processes to is the 8-bit one, not BF16's."""
    assert cache_by_hand_8bit(MICRO, 512) < cache_by_hand(MICRO, 512)


@pytest.mark.timeout(600)
def test_generate_wires_the_8bit_cache(tmp_path):
    rec = tmp_path / "calls.jsonl"
    r = _run(["generate", "--prompt", "def", "--max-tokens", "2", "--max-kv-size", "512",
              "--ignore-chat-template", "--kv-bits", "8"], rec)
    assert r.returncode == 0, r.stderr
    want = file_weight_bytes(MICRO) + cache_by_hand_8bit(MICRO, 512)
    bf16 = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 512)
    assert want != bf16
    calls = fake_metal.records(rec)
    assert [c["limit"] for c in calls] == [want, 0], (want, bf16, calls)


@pytest.mark.timeout(600)
def test_pipeline_stage_wires_the_8bit_cache(tmp_path):
    from kimi_mlx.testing.cluster import LocalCluster

    rec = tmp_path / "calls.jsonl"
    cluster = LocalCluster(tmp_path, n=2, ckpt=MICRO, env=fake_metal.env(MAC64, rec, base={}))
    try:
        transport, stages = cluster.load_transport(kv=(8, 64))
        transport.shutdown()
        calls = _wait_records(rec, lambda r: len(r) >= 2, loaded=lambda: True)
    finally:
        cluster.stop()
    by_pid = {c["pid"]: c["limit"] for c in calls if c["limit"]}
    n = cluster.args.num_hidden_layers
    trained = text_config(MICRO)["max_position_embeddings"]
    # the stage holding the DSA layers is the one whose figure changes
    changed = 0
    for proc, st in zip(cluster.procs, stages):
        layers = range(st.start, st.end)
        weights = layer_weight_bytes(MICRO, st.start, st.end, n)
        want = weights + cache_by_hand_8bit(MICRO, trained, layers=layers)
        changed += want != weights + cache_by_hand(MICRO, trained, layers=layers)
        assert by_pid[proc.proc.pid] == want, (st, want, calls)
    assert changed >= 1


@pytest.mark.timeout(600)
def test_tensor_rank_started_alone_wires_the_8bit_cache(tmp_path):
    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.testing.ports import free_ports
    from kimi_mlx.testing.tensor_parallel import write_hostfile

    rec = tmp_path / "calls.jsonl"
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    hosts = write_hostfile(tmp_path / "hosts.json", free_ports(2))
    try:
        for r in range(2):
            env = fake_metal.env(MAC64, rec)
            env.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hosts))
            with open(logs[r], "w") as out:
                procs.append(subprocess.Popen(
                    [PY, "-m", "kimi_mlx.cluster.tensor.rank", "--model", str(MICRO),
                     "--backend", "ring", "--name", f"n{r}", "--cache-bytes", "0",
                     "--kv-bits", "8", "--kv-group-size", "64", "--planned-tokens", "1024"],
                    env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        calls = _wait_records(rec, lambda rs: {c["pid"] for c in rs} >= {p.pid for p in procs},
                              timeout=300,
                              loaded=lambda: all("loaded its slices" in l.read_text() for l in logs))
    finally:
        for p in procs:
            _kill(p)
    by_pid = {c["pid"]: c["limit"] for c in calls if c["limit"]}
    for r, p in enumerate(procs):
        _, stats = load_sharded(MICRO, _Group(2, r))  # the bytes of its slices, as read
        # half of every KDA layer's heads' state, the attention caches whole (8-bit)
        want = stats["needed"] + cache_by_hand_8bit(MICRO, 1024, kda_share=0.5)
        bf16 = stats["needed"] + cache_by_hand(MICRO, 1024, kda_share=0.5)
        assert want != bf16
        assert by_pid[p.pid] == want, (r, want, bf16, calls, [l.read_text()[-1500:] for l in logs])

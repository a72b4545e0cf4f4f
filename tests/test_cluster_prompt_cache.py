"""Pieces of the cluster prompt cache, without processes: a stage's LRU of snapshots
(restored caches continue exactly as the cache they were taken from; eviction by bytes,
least recently used first), the head's choice of prefixes and snapshot points, and
prefill chunks that end at every snapshot point."""

import random

import mlx.core as mx
import pytest

from kimi_mlx.cluster.net.session import prefill_chunks
from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
from kimi_mlx.cluster.node.stage_cache import StageCache
from kimi_mlx.cluster.net.cache_keys import key_length, prefix_key


def test_prefill_chunks_end_at_every_stop():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 90)
        chunk = rng.randint(1, 20)
        start = rng.randint(0, n - 1)
        stops = rng.sample(range(0, 100), rng.randint(0, 6))
        got = prefill_chunks(n, chunk, start, stops)
        # contiguous from start to the last prompt token (excluded), none empty or too long
        assert [o for o, _ in got] == [start + sum(l for _, l in got[:i]) for i in range(len(got))]
        assert sum(l for _, l in got) == n - 1 - start
        assert all(1 <= l <= chunk for _, l in got)
        ends = {o + l for o, l in got}
        assert {s for s in stops if start < s < n - 1} <= ends
    assert prefill_chunks(10, 4) == [(0, 4), (4, 4), (8, 1)]  # the old behaviour


def test_prefix_keys_name_length_and_content():
    assert key_length(prefix_key([1, 2, 3])) == 3
    assert prefix_key([1, 2, 3]) != prefix_key([1, 2, 4]) and prefix_key([]) != prefix_key([0])
    with pytest.raises(ValueError, match="not '<length>-<32 hex digits>'"):
        key_length("x-1")


def _model():
    from kimi_mlx.testing.checkpoints import random_model, tiny_text_config
    from kimi_mlx.model.config import ModelArgs

    args = ModelArgs.from_config(tiny_text_config())
    return random_model(args, seed=3)


def test_a_restored_snapshot_continues_as_the_original_cache():
    model = _model()
    ids = mx.array([[5, 9, 2, 7, 1, 3, 3, 8, 4, 6, 2, 1]])
    cache = model.make_cache()
    model(ids[:, :8], cache=cache)
    sc = StageCache(1 << 30)
    assert sc.store(prefix_key(ids[0, :8].tolist()), 8, cache)
    want = model(ids[:, 8:], cache=cache)  # the original goes on (its state changes)
    restored = sc.restore(prefix_key(ids[0, :8].tolist()), 8)
    got = model(ids[:, 8:], cache=restored)
    assert mx.array_equal(got, want)
    assert sc.restore(prefix_key(ids[0, :8].tolist()), 7) is None  # wrong length: a miss


def test_stage_cache_evicts_least_recently_used_by_bytes():
    model = _model()
    sc = StageCache(1 << 30)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    sc.store("4-" + "a" * 32, 4, cache)
    one = sc.nbytes
    sc.max_bytes = 2 * one  # room for two snapshots of this size
    sc.store("4-" + "b" * 32, 4, cache)
    assert sc.held(["4-" + "a" * 32]) == ["4-" + "a" * 32]  # a is now the most recent
    sc.store("4-" + "c" * 32, 4, cache)
    assert sc.held(["4-" + k * 32 for k in "abc"]) == ["4-" + "a" * 32, "4-" + "c" * 32]
    assert sc.evictions == 1 and sc.nbytes == 2 * one
    sc.max_bytes = one - 1
    assert not sc.store("4-" + "d" * 32, 4, cache)  # larger than the whole bound: not kept
    sc.clear()
    assert len(sc) == 0 and sc.nbytes == 0


def test_head_index_plans_the_one_process_points_and_finds_prefixes():
    from kimi_mlx.server.prompt_cache import snapshot_points

    idx = HeadCacheIndex(every=8)
    ids = list(range(100, 130))
    plan = idx.plan(ids, 0, [5, 12, 29, 40])
    assert sorted(plan) == snapshot_points(len(ids), 0, [5, 12, 29, 40], 8) == [5, 8, 12, 16, 24, 29]
    assert all(plan[e] == prefix_key(ids[:e]) for e in plan)
    longer = ids + [1, 2, 3]
    assert idx.candidates(longer) == sorted(((e, plan[e]) for e in plan), reverse=True)
    assert idx.candidates(ids[:5]) == []  # a prefix must leave the last token to run
    assert idx.candidates([0] + ids) == []

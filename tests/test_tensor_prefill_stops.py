"""A tensor group's prefill is split at the same positions with and without a prompt
cache, as one process's is (tests/test_cached_equals_cache_free.py): a reply from a
snapshot then runs the same float operations as a cache-free one. Model-free: a
recording stand-in for `step.GroupTarget`; the reference is the cached run's own chunk
ends (where it takes its snapshots), against the cache-free run of the same prompt."""

from __future__ import annotations

import pytest

import kimi_mlx.cluster.tensor.step as step
from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
from kimi_mlx.cluster.net.session import RemoteSession
from kimi_mlx.cluster.tensor.prefill import open_request
from kimi_mlx.server.prompt_cache import DEFAULT_EVERY


class _Recording(RemoteSession):
    """`step.GroupTarget`'s prefill (the shared `RemoteSession.prefill`) with the
    group's forward command replaced by a record of where each chunk ends."""

    def __init__(self, model, group, n_prefill, restore=(), store=None, prefill_chunk=2048):
        super().__init__(n_prefill, prefill_chunk)
        self.ends, self.snaps = [], []

    def _prefill_chunk(self, ids, media, snapshot, targets, top_k):
        self.ends.append(self.offset + len(ids))
        if snapshot:
            self.snaps.append(self.offset + len(ids))

    def end(self, ok=True):
        pass


@pytest.mark.parametrize("n,segment_ends", [(5000, [300, 2500]), (9000, []), (700, [100])])
def test_cache_free_chunks_end_where_the_cached_run_snapshots(monkeypatch, n, segment_ends):
    monkeypatch.setattr(step, "GroupTarget", _Recording)
    ids = [i % 97 for i in range(n)]
    cached = open_request(None, None, ids, index=HeadCacheIndex(every=DEFAULT_EVERY),
                          segment_ends=segment_ends)
    free = open_request(None, None, ids, segment_ends=segment_ends)
    assert cached.snaps, "the cached run took no snapshot: nothing compared"
    assert set(cached.snaps) <= set(cached.ends)
    assert free.ends == cached.ends and free.snaps == []
    assert free.ends[-1] == n - 1

"""The pipeline head splits a prompt's prefill at the same positions with and without a
prompt cache (as one process and the tensor group do): a reply restored from a snapshot
then runs the float operations of a cache-free one. Model-free: `Pipeline` over a
recording transport; the reference is the cached run's chunks (`HeadCacheIndex.plan`
snapshots, where the stages keep prefixes), against the cache-free head engine's."""

from __future__ import annotations

import pytest

from kimi_mlx.cluster.head.engine import ClusterEngine
from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.cluster.net.cache_index import HeadCacheIndex
from kimi_mlx.server.jobs import Job
from kimi_mlx.server.prompt_cache import DEFAULT_EVERY
from kimi_mlx.sampling import Sampling


class _Reply:
    token, logprobs, scores = 7, None, None


class _Recording:
    """A transport that records each prefill chunk (offset, length) and answers 7."""

    def __init__(self):
        self.chunks, self.keys = [], []

    def open(self, sid, sampling, return_logprobs, restore=None):
        pass

    def send(self, sid, seq, offset, tokens, sample=False, snapshot_key=None, **kw):
        if not sample:
            self.chunks.append((offset, len(tokens)))
            self.keys.append(snapshot_key)

    def receive(self, sid, timeout):
        return _Reply()

    def close(self, sid):
        pass

    cancel = close


@pytest.mark.parametrize("n,segment_ends", [(5000, [300, 2500]), (2100, []), (300, [100])])
def test_cache_free_chunks_end_where_the_cached_run_snapshots(n, segment_ends):
    ids = [i % 97 for i in range(n)]
    cached = _Recording()
    snaps = HeadCacheIndex(every=DEFAULT_EVERY).plan(ids, 0, segment_ends)
    list(Pipeline(cached, 128).generate(ids, Sampling(), 1, snapshots=snaps))
    assert any(cached.keys), "the cached run took no snapshot: nothing compared"

    free = _Recording()
    pipe = Pipeline(free, 128)
    engine = ClusterEngine(pipe, eos_ids=[0], max_concurrency=1)
    try:
        job = Job(ids, 1, Sampling(), segment_ends=segment_ends)
        engine._run(job)
    finally:
        engine.stop()
    assert free.chunks == cached.chunks and not any(free.keys)

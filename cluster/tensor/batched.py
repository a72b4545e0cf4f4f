"""The tensor group's server with --max-concurrency > 1: the
one-process server's continuous batching loop (`server.batch.run_batched`, mlx-lm's
`BatchGenerator`) run on rank 0's request path over the group's batched rows
(`tensor.rows.GroupRows`), not a third batching loop.

`BatchHost` is what `run_batched` reads of an engine, answered for a `TensorEngine`: its
model is the `GroupRows` stand-in; a job's cache starts from the longest prefix every
rank holds (`RowPromptCache.fetch`: rank 0's `HeadCacheIndex` offers the prefixes, the
ranks agree) or fresh; snapshots are taken where the one-process policy says
(`server.prompt_cache.snapshot_points`) and kept by every rank under rank 0's key; a
prompt with images left to prefill is prefilled alone (its chunks with image pads carry
the projector rows, MEDIA) and joins for its last token, as in one process; a scored
prompt (`Job.score`) is prefilled alone with its logits kept (`server.scoring.
score_prefill`) and joins likewise.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from kimi_mlx.cluster.tensor.prompt_cache import MAX_CANDIDATES


class RowPromptCache:
    """The prompt-cache API `run_batched` uses (`every`, `store`, `note_prompt_speed`),
    over rank 0's `net.cache_index.HeadCacheIndex` and the ranks' stores."""

    def __init__(self, index, rows, store=None, count=None):
        self.index, self.rows, self.disk_store, self.count = index, rows, store, count
        self.every = index.every

    def fetch(self, key: Sequence, segment_ends: Sequence[int] = ()):
        """(RowCache, positions restored) for a prompt with cache key `key`: the longest
        remembered prefix every rank holds (`prefill.open_request`'s rules, counted the
        same way), else a fresh row and 0."""
        index = self.index
        cands = index.candidates(key)[:MAX_CANDIDATES]
        guessed = False
        if not cands and getattr(self.disk_store, "disk", None) is not None:
            cands, guessed = index.policy_candidates(key, segment_ends)[:MAX_CANDIDATES], True
        if not cands:
            if self.count is not None:
                self.count("miss")
            return self.rows.new_row(), 0
        row, n = self.rows.restore_row([k for _, k in cands])
        if self.count is not None:
            if guessed:
                if n:
                    self.count("disk")
            else:
                self.count("hit" if n == cands[0][0] else "shorter" if n else "miss")
        return row, n

    def store(self, key: Sequence, cache) -> None:
        """Every rank keeps its shard of single-sequence `cache` ([RowCache]) under the key
        of prefix `key` (remembered in the index)."""
        from kimi_mlx.cluster.net.cache_keys import prefix_key

        key = list(key)
        n = len(key)
        # remember the prefix as the index's plan does (the plan of one point at n)
        planned = self.index.plan(key + [0], n - 1, [n]) if n else {}
        self.rows.snapshot_row(cache[0], planned.get(n) or prefix_key(key))

    def note_prompt_speed(self, tokens: int, seconds: float) -> None:
        """(the one-process cache tunes its policy by it; the group's index does not)"""


class _Logits:
    """`GroupRows` asked for the logits of every position (a scored prompt)."""

    def __init__(self, rows):
        self.rows = rows

    def __call__(self, x, cache=None, **kw):
        return self.rows(x, cache=cache, logits=True)


class BatchHost:
    """What `server.batch.run_batched` reads of an engine, for `TensorEngine` `engine`
    (module doc); `active` is the engine's."""

    def __init__(self, engine, rows):
        object.__setattr__(self, "engine", engine)
        self.model = rows
        self.eos_ids = engine.eos_ids
        self.max_concurrency = engine.max_concurrency
        self.metrics = engine.metrics
        self.prompt_cache = None
        if engine.prompt_cache is not None:
            self.prompt_cache = RowPromptCache(engine.prompt_cache, rows, engine.store,
                                               engine.count_lookup)

    feeds_media_by_id = False  # `GroupRows` takes image rows per prefill chunk (MEDIA)

    def stopping(self) -> bool:
        return self.engine.stopping()

    def next_job(self, block: bool = True):
        return self.engine.next_job(block)

    def batch_drafts(self):
        """The engine's batched n-gram drafts (`BaseEngine.batch_drafts`), or None."""
        return self.engine.batch_drafts()

    def speculates(self, job) -> bool:
        return self.engine.speculates(job)

    @property
    def pad_id(self) -> Optional[int]:
        return self.engine.pad_id

    @property
    def vision(self):
        return self.engine.vision

    @property
    def active(self) -> int:
        return self.engine.active

    @active.setter
    def active(self, n: int) -> None:
        self.engine.active = n

    def start_cache(self, job):
        """(cache [RowCache], prompt positions it holds) for a job."""
        if self.prompt_cache is not None and job.score is None:
            row, n = self.prompt_cache.fetch(job.cache_key, job.segment_ends)
            return [row], n
        return [self.model.new_row()], 0

    def cache_models(self, cache):
        return [(_Logits(self.model), cache)]

    def snapshot_points(self, ids: Sequence[int], start: int,
                        segment_ends: Sequence[int]) -> List[int]:
        """Where a prefill stops (and the prompt cache, if any, keeps a snapshot): the
        same points with or without a prompt cache (`prompt_cache.DEFAULT_EVERY`
        without), as the one-process `server.engine.Engine.snapshot_points`, so that a
        reply from a snapshot runs the float operations of a cache-free one. Before,
        a cache-free group prefilled each prompt in one piece, and its logits differed
        from a restored reply's in the low bits."""
        from kimi_mlx.server.prompt_cache import DEFAULT_EVERY, snapshot_points

        every = self.prompt_cache.every if self.prompt_cache is not None else DEFAULT_EVERY
        return snapshot_points(len(ids), start, segment_ends, every)

    def embeddings(self, job, start: int):
        """The image rows [pads, hidden] of a job with image pads left to prefill after
        `start` (the tower runs here), else None."""
        engine = self.engine
        if not job.images or engine.pad_id not in job.ids[start:-1]:
            return None
        import mlx.core as mx

        rows = engine.vision.features(job.images)
        mx.eval(rows)
        return rows

    def prefill(self, ids: List[int], cache, start: int, segment_ends: Sequence[int],
                step: int = 2048, embeddings=None, key: Optional[Sequence] = None) -> None:
        """Run ids[start:-1] into single-sequence `cache` alone, with snapshots where the
        policy says; `embeddings`: the image rows of all of ids' pads (`embeddings`), each
        chunk holding pads carries its own (MEDIA)."""
        import mlx.core as mx

        from kimi_mlx.cluster.net.session import chunk_media, prefill_chunks

        key = ids if key is None else key
        snaps = set(self.snapshot_points(ids, start, segment_ends))
        media = (self.engine.pad_id, embeddings) if embeddings is not None else None
        for off, n in prefill_chunks(len(ids), step, start, snaps):  # the sessions' chunking
            self.model(mx.array(ids[off:off + n])[None], cache=cache,
                       media=chunk_media(media, ids, off, n))
            if self.prompt_cache is not None and off + n in snaps:
                self.prompt_cache.store(key[:off + n], cache)

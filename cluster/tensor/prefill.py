"""A request's start on a tensor group with the prompt cache and images:
`open_request` restores the longest prefix every rank holds (`prompt_cache.
agree_restore`), prefills the rest with snapshots where the policy says and image rows in
the chunks that hold their pads (`net.session.RemoteSession.prefill`, the pipeline's
prefill too), and hands back the `step.GroupTarget` for decoding."""

from __future__ import annotations

from typing import Optional, Sequence

from kimi_mlx.cluster.tensor.prompt_cache import MAX_CANDIDATES


def open_request(model, group, ids: Sequence[int], *, key: Optional[Sequence] = None,
                 index=None, store=None, segment_ends: Sequence[int] = (), media=None,
                 step: int = 2048, count=None):
    """Begin a request on every rank and prefill its prompt but the last token: from the
    longest remembered prefix every rank still holds (`index`, a
    `net.cache_index.HeadCacheIndex`; `agree_restore`), taking snapshots on every rank
    where the policy says (`index.plan`), with image rows placed in the chunks that hold
    pads (`media`: (pad id, rows [pads in ids, hidden]) from rank 0's tower, or a
    callable with a `pad_id` attribute returning the rows, called only when a chunk left
    to prefill holds pads).

    Args:
        ids: the prompt's token ids. key: its cache key (`Job.cache_key`: ids with image
            pads as (pad id, digest)); default the ids.
        index / store: rank 0's record of snapshot prefixes and its own shard's
            `KeyedSnapshotCache`; None / None: no prompt cache (the chunks then end at
            the same policy points all the same, as one process's `Engine.prefill`).
        step: prefill tokens per forward command.
        count: called with "hit" (the longest remembered prefix restored), "shorter" (a
            rank had lost it: a shorter one all held), "miss" (full prefill: none
            remembered, none held by every rank, or a rank failed to restore it) or "disk"
            (none remembered, a policy prefix restored from the ranks' disk tiers), for
            /metrics.
    Returns:
        the `step.GroupTarget` (its `cached` the positions restored) at position
        len(ids) - 1: decode goes on from the last prompt token (`net.session.generate`
        over it). The caller ends it; it is ended here when the prefill raises.
    """
    from kimi_mlx.cluster.net.cache_keys import prefix_key
    from kimi_mlx.cluster.tensor.step import GroupTarget

    ids = [int(t) for t in ids]
    key = ids if key is None else list(key)
    cands = [] if index is None else index.candidates(key)[:MAX_CANDIDATES]
    guessed = False
    if index is not None and not cands and getattr(store, "disk", None) is not None:
        # rank 0 remembers none of this prompt's prefixes (it restarted, or forgot them):
        # offer where the policy would have snapshotted them; ranks with a disk tier may
        # hold them from before (counted as "disk" when restored, not counted otherwise)
        cands, guessed = index.policy_candidates(key, segment_ends)[:MAX_CANDIDATES], True
    target = GroupTarget(model, group, len(ids) - 1, restore=[k for _, k in cands],
                         store=store, prefill_chunk=step)
    try:
        cached = target.cached
        if index is not None and count is not None:
            if guessed:
                if cached:
                    count("disk")
            else:
                count("hit" if cands and cached == cands[0][0] else "shorter" if cached else "miss")
        snaps = index.plan(key, cached, segment_ends) if index is not None else {}
        # without a prompt cache the chunks still end at the policy's points, so that a
        # reply from a snapshot and a cache-free one run the same float operations
        stops = () if index is not None else _policy_points(ids, cached, segment_ends)
        if callable(media):  # the tower runs only when a chunk to prefill holds pads
            media = (media.pad_id, media)
        target.prefill(ids, snapshots={e: k or prefix_key(key[:e]) for e, k in snaps.items()},
                       stops=stops, media=media)
    except BaseException:
        target.end()
        raise
    return target


def _policy_points(ids: Sequence[int], start: int, segment_ends: Sequence[int]) -> list:
    """Where a cache-free prefill stops: `server.prompt_cache.snapshot_points` with its
    default spacing, as the one-process `Engine.snapshot_points` does without a cache."""
    from kimi_mlx.server.prompt_cache import DEFAULT_EVERY, snapshot_points

    return snapshot_points(len(ids), start, segment_ends, DEFAULT_EVERY)

"""The deciding side of the cluster's prompt cache (a pipeline's head, a tensor group's
rank 0): which prefixes it asked the stages / ranks to snapshot, and where to take the
next ones (see `node.stage_cache`, `tensor.prompt_cache`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

from kimi_mlx.cluster.net.cache_keys import prefix_key


class HeadCacheIndex:
    """The head's (or rank 0's) record of the prefixes it asked the stages (ranks) to
    snapshot (token tuples, the newest `max_entries`); their own LRUs decide what is still
    there.

    Args:
        every: snapshot every this many prefill tokens too (0: only at message ends).
        max_entries: prefixes remembered.
    """

    def __init__(self, every: int = 1024, max_entries: int = 4096):
        self.every = every
        self.max_entries = max_entries
        self._prefixes: "OrderedDict[Tuple[int, ...], str]" = OrderedDict()
        self._lock = threading.Lock()

    def candidates(self, ids: Sequence[int]) -> List[Tuple[int, str]]:
        """(length, key) of the remembered prefixes of ids[:-1] (the last prompt token
        always runs), longest first."""
        out = []
        with self._lock:
            for p, key in self._prefixes.items():
                n = len(p)
                if n < len(ids) and tuple(ids[:n]) == p:
                    out.append((n, key))
        return sorted(out, reverse=True)

    def policy_candidates(self, ids: Sequence, segment_ends: Sequence[int]) -> List[Tuple[int, str]]:
        """(length, key) of every prefix of ids[:-1] the snapshot policy would have taken
        (`snapshot_points` from 0: message ends and multiples of `every`), longest first,
        whether remembered or not: what stages that keep snapshots on disk may hold from
        before this head started. Keys hashed in one pass (`server.disk_cache.prefix_keys`,
        the `prefix_key` scheme)."""
        from kimi_mlx.server.disk_cache import prefix_keys
        from kimi_mlx.server.prompt_cache import snapshot_points

        points = snapshot_points(len(ids), 0, segment_ends, self.every)
        keys = prefix_keys(ids, points)
        return sorted(((n, keys[n]) for n in points), reverse=True)

    def plan(self, ids: Sequence[int], start: int, segment_ends: Sequence[int]) -> Dict[int, str]:
        """{position e: key} of the snapshots to take while prefilling ids from `start`
        (`snapshot_points`), remembered from now on."""
        from kimi_mlx.server.prompt_cache import snapshot_points

        points = snapshot_points(len(ids), start, segment_ends, self.every)
        out = {}
        with self._lock:
            for e in points:
                p = tuple(ids[:e])
                key = self._prefixes.get(p) or prefix_key(p)
                self._prefixes[p] = key
                self._prefixes.move_to_end(p)
                out[e] = key
            while len(self._prefixes) > self.max_entries:
                self._prefixes.popitem(last=False)
        return out


def lookup_counter(registry):
    """The /metrics counter of prompt-cache lookups by result, one for the pipeline's head
    and a tensor group's rank 0: kimi_mlx_cluster_prompt_cache_lookups_total{result}."""
    from prometheus_client import Counter

    return Counter(
        "kimi_mlx_cluster_prompt_cache_lookups", "requests that found remembered prompt "
        "prefixes, by result: hit (the longest restored on every stage / rank), shorter (a "
        "stage or rank had lost it: a shorter prefix all held), miss (none held by all: full "
        "prefill), refused (pipeline: lost between lookup and open: full prefill), disk "
        "(none remembered, e.g. after a restart, but every stage / rank held one of the "
        "policy's prefixes: on their disks)", ["result"], registry=registry)


def lookup_count(metrics):
    """count(result): adds one to `lookup_counter`'s result in `metrics`' registry (the
    server's `Metrics`); does nothing when `metrics` is None."""
    if metrics is None:
        return lambda result: None
    counter = lookup_counter(metrics.registry)
    return lambda result: counter.labels(result).inc()

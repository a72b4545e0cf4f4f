"""The head's side of the cluster's prompt cache: `net.cache_index.HeadCacheIndex` (it
lives in net/, which a tensor group's rank 0 shares)."""

from kimi_mlx.cluster.net.cache_index import HeadCacheIndex

__all__ = ["HeadCacheIndex"]

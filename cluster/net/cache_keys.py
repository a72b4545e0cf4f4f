"""Names of prompt-cache snapshots, as the head and the stages both write them: a key is
the token prefix it holds (`prefix_key`), and a stage refuses a restore it does not hold
with `CACHE_MISS` in its message (see `node.stage_cache`)."""

from __future__ import annotations

from typing import Sequence

CACHE_MISS = "prompt cache miss"

def prefix_key(ids: Sequence) -> str:
    """The key of the snapshot holding exactly the tokens `ids`: '<length>-<sha256 of
    the int32 little-endian ids, 32 hex digits>', the one scheme of every prompt cache
    (`server.disk_cache.token_key`, which the disk tier and one process use too). A prompt
    with images gives its `server.images.cache_key`, whose pads are (pad id, image digest)
    pairs: each is hashed as the pad id then the digest's bytes, so the same text with
    another image has another key from the first image on."""
    from kimi_mlx.server.disk_cache import token_key

    return token_key(ids)


def key_length(key: str) -> int:
    """Positions a snapshot key holds (ValueError when it is not a `prefix_key`)."""
    n, _, digest = key.partition("-")
    if not n.isdigit() or len(digest) != 32:
        raise ValueError(f"prompt cache key {key[:80]!r} is not '<length>-<32 hex digits>'")
    return int(n)

"""A node's rank process of a tensor-parallel group (`python -m kimi_mlx.cluster.tensor.rank`,
started by the node's `StartRank`, see `node.rank`): join the group, load this rank's
slices, follow rank 0's commands (`tensor.step`).

Stops: SIGTERM or SIGHUP end it cleanly (its queued prompt-cache writes finished, exit 0;
`net.lifetime`) as soon as its main thread is out of a collective (an idle rank sleeps
on the doorbell, `tensor.wire`, and stops at once); it also stops when its node's
process is gone (`net.lifetime.watch_parent_from_env`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import mlx.core as mx

from kimi_mlx.cluster.net.ranks import BACKENDS


def _remove_group_files() -> None:
    """Remove the host / device file the node wrote for this rank (MLX has read it in
    `init`), so none is left in the temp folder when the node itself is killed later."""
    for var in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
        path = os.environ.get(var, "")
        if os.path.basename(path).startswith(("kimi-mlx-hosts-", "kimi-mlx-ibv-")):
            try:
                os.unlink(path)
            except OSError:
                pass


def wire_rank(model_path, group, who: str, tokens: int = 0, sequences: int = 0,
              kv=(None, None)) -> None:
    """MLX's wired limit for this rank's slices and caches before loading them
    (`placement.wired.rank_plan`; a no-op without Metal), the caches of `sequences`
    sequences of `tokens` tokens (the head's plan, `RankRequest.planned_tokens` /
    `planned_sequences`; 0: the trained context / one sequence) in the format `kv`
    ((kv_bits or None/0, kv_group_size): `RankRequest.kv_bits` / `kv_group_size`).
    Raises `WiredLimitError` (one line with the sysctl to run) when they exceed the
    Mac's GPU working set."""
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP
    from kimi_mlx.placement.wired import rank_plan, wire

    wire(lambda: rank_plan(model_path, group.size(), group.rank(), who,
                           context=int(tokens) or None, sequences=max(1, int(sequences)),
                           kv_bits=kv[0] or None,
                           kv_group_size=int(kv[1] or KV_DEFAULT_GROUP)))


def rank_main(argv: Optional[Sequence[str]] = None) -> int:
    """A node's rank process (`python -m kimi_mlx.cluster.tensor.rank --model PATH`, with
    MLX_RANK / MLX_HOSTFILE set): join the group, load this rank's slices, follow rank 0.
    Raises `net.lifetime.Stopped` on SIGTERM / SIGHUP (the caller exits 0)."""
    from kimi_mlx.cluster.net.lifetime import exit_on_signals, watch_parent_from_env

    exit_on_signals()
    watch_parent_from_env(on_gone=_remove_group_files)
    p = argparse.ArgumentParser(description="one tensor-parallel rank of a kimi-mlx cluster")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="ring", choices=BACKENDS)
    p.add_argument("--name", default="", help="node name for messages")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="bytes of prompt-cache snapshots of this rank's shard (default: a "
                        "quarter of the memory left after loading; 0: none)")
    p.add_argument("--prompt-cache-dir", default=None,
                   help="also keep this rank's snapshots in this folder (its node's "
                        "`cluster serve --prompt-cache-dir`)")
    p.add_argument("--prompt-cache-disk-bytes", type=int, default=0,
                   help="bytes of snapshot files kept there")
    p.add_argument("--kv-bits", type=int, default=0,
                   help="the DSA caches' format: 0 the model dtype, 8 8-bit (`--kv-bits`)")
    p.add_argument("--kv-group-size", type=int, default=64, help="values per scale (8-bit)")
    p.add_argument("--planned-tokens", type=int, default=0,
                   help="tokens per sequence this rank's wired memory is planned for (the "
                        "head's context; default 0: the trained context)")
    p.add_argument("--planned-sequences", type=int, default=0,
                   help="sequences decoded together, for the same plan (default 0: one)")
    a = p.parse_args(argv)
    who = f"rank {os.environ.get('MLX_RANK', '?')}" + (f" on node {a.name}" if a.name else "")
    from kimi_mlx.checkpoint.ranged import load_sharded

    from kimi_mlx.cluster.tensor.step import follow_commands

    try:
        group = mx.distributed.init(backend=a.backend, strict=True)
        _remove_group_files()
        print(f"[tensor] {who}: joined a {a.backend} group of {group.size()}", file=sys.stderr,
              flush=True)
        wire_rank(a.model, group, who, a.planned_tokens, a.planned_sequences,
                  (a.kv_bits, a.kv_group_size))
        model, _ = load_sharded(a.model, group)
        model.set_kv_quant(a.kv_bits or None, a.kv_group_size)
        print(f"[tensor] {who}: loaded its slices of {a.model}", file=sys.stderr, flush=True)
        from kimi_mlx.cluster.tensor.prompt_cache import make_store, rank_fingerprint

        fp = (rank_fingerprint(a.model, model, group.rank(), group.size())
              if a.prompt_cache_dir else None)
        store = make_store(a.cache_bytes, a.prompt_cache_dir, a.prompt_cache_disk_bytes, fp, who)
        try:
            n = follow_commands(model, group, store)
        finally:  # also on SIGTERM (`net.lifetime.Stopped`)
            if store is not None:
                store.attach_disk(None)  # queued snapshot writes finish before the rank exits
    except Exception as e:  # a lost peer, a bad checkpoint: say who, exit non-zero
        print(f"[tensor] {who}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"[tensor] {who}: done after {n} request(s)", file=sys.stderr, flush=True)
    return 0


def _main() -> int:
    from kimi_mlx.cluster.net.lifetime import Stopped

    try:
        return rank_main()
    except Stopped as e:
        print(f"[tensor] rank {os.environ.get('MLX_RANK', '?')}: stopped ({e})",
              file=sys.stderr, flush=True)
        return 0


if __name__ == "__main__":
    # as rank 0's child (`tensor.relay`): once a ring group was joined, interpreter exit
    # can block on the backend's threads
    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

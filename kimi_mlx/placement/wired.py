"""MLX's wired memory limit for a process that holds weights, sized from the plan.

On a Mac, Metal pages GPU memory out unless it is wired; a model near the Mac's size then
decodes at disk speed. mlx-lm wires memory in `mlx_lm.generate.wired_limit` (around
`stream_generate`) and `mlx_lm.utils.maybe_set_recommended_wired_limit` (server start):
`mx.set_wired_limit(max_recommended_working_set_size)`, restored at the end. Every kimi-mlx
process that holds weights does the same before it loads (`wire`), with the limit sized
from this package's figures for what that process will hold (`WiredPlan`: the weights it
loads from the checkpoint's headers, `layer_bytes` / `tensor_parallel`, plus the planned
cache at its context and sequences) and restored at exit (atexit, or `restore`).

Where the plan exceeds the GPU's working set (`max_recommended_working_set_size`, which
macOS derives from `sysctl iogpu.wired_limit_mb`), the process refuses to start with one
line (`WiredLimitError`) giving `sudo sysctl iogpu.wired_limit_mb=N`, N the plan plus the
planner's headroom (`StagePlanner`: 10%, at least 2 GiB) in MiB, instead of paging. An
explicit `--allow-paging` (or KIMI_MLX_ALLOW_PAGING=1, which the flag exports so rank
processes a node starts inherit it) goes on anyway with a warning, wired up to the limit.

Without Metal (Linux, the CPU backend) `wire` does nothing and says so at debug level.

Callers: `kimi-mlx generate`, `chat`, `eval`, the one-process server (`server.serving.
load_service`), a pipeline stage's `Load` (`cluster.node.loading`), each tensor rank
(`cluster.tensor.rank`, rank 0 in `cluster.tensor.group`), `kimi-mlx prune`.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple, Union

import mlx.core as mx

from kimi_mlx.placement.layer_bytes import KV_CACHE_DEFAULT_GROUP, ModelBytes
from kimi_mlx.placement.layer_bytes import cache_bytes as layer_cache_bytes
from kimi_mlx.placement.layer_bytes import model_bytes_from_checkpoint

log = logging.getLogger(__name__)

ALLOW_PAGING_ENV = "KIMI_MLX_ALLOW_PAGING"
MiB = 2**20
GiB = 2**30
# the planner's headroom rule (`planner.StagePlanner` defaults): kept free on a node for
# activations, the Metal heap and the process itself
HEADROOM = 0.10
MIN_HEADROOM_BYTES = 2 * GiB


class WiredLimitError(ValueError):
    """The plan does not fit this Mac's GPU working set; the message is one line with the
    `sudo sysctl iogpu.wired_limit_mb=N` that makes it fit (a ValueError so the commands'
    usual error paths print it)."""


@dataclass(frozen=True)
class WiredPlan:
    """What one process will hold, bytes.

    Attributes:
        what: the process, for messages ("kimi-mlx generate", "stage 1 layers [3, 6)").
        weight_bytes: tensor bytes it loads, as stored in the checkpoint.
        cache_bytes: its planned caches (or, for the prune pass, its activations).
        note: how the cache was sized ("4096 tokens x 1 sequence").
    """

    what: str
    weight_bytes: int
    cache_bytes: int
    note: str = ""

    @property
    def total_bytes(self) -> int:
        return int(self.weight_bytes) + int(self.cache_bytes)

    def describe(self) -> str:
        return (f"weights {size(self.weight_bytes)} + cache {size(self.cache_bytes)}"
                + (f" at {self.note}" if self.note else ""))


def size(n: int) -> str:
    """Bytes as GiB (two decimals), or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def limit_mb_for(planned_bytes: int) -> int:
    """The `iogpu.wired_limit_mb` (MiB) under which `planned_bytes` fits with the
    planner's headroom: the smallest U with U - max(10% U, 2 GiB) >= planned_bytes."""
    usable = max(math.ceil(planned_bytes / (1 - HEADROOM)), planned_bytes + MIN_HEADROOM_BYTES)
    return -(-usable // MiB)


# -- plans of each process kind ----------------------------------------------------------

def serving_tokens(max_position_embeddings: int, max_kv_size: Optional[int]) -> int:
    """Tokens a sequence's cache is planned for: --max-kv-size when given, else the
    checkpoint's trained context (`generation.request.serving_context`'s rule)."""
    return int(max_kv_size) if max_kv_size else int(max_position_embeddings)


def _kv_note(kv_bits: Optional[int], kv_group_size: int) -> str:
    return f", {kv_bits}-bit cache (group {kv_group_size})" if kv_bits else ""


def draft_bytes(drafts, target: ModelBytes, tokens: int, sequences: int) -> Tuple[int, int, str]:
    """(weight bytes, cache bytes, note) a draft adds to its target's process: the MTP
    layers of the target checkpoint (`--draft mtp`: loaded beside the trunk, counted
    apart as `not_loaded["mtp"]`), or a `--draft-model` folder's tensors (each
    *.safetensors file less its header) and, when it is a kimi-mlx checkpoint, its caches
    at `tokens` x `sequences`. Nothing for n-gram drafts, no draft, or a draft model that
    is a hub id not downloaded yet or cannot be read (its own load then says why)."""
    if drafts is None:
        return 0, 0, ""
    if getattr(drafts, "kind", None) == "mtp":
        mtp = int(target.not_loaded.get("mtp", 0))
        return mtp, 0, " + the MTP layers" if mtp else ""
    folder = Path(getattr(drafts, "model", None) or "")
    shards = sorted(folder.glob("*.safetensors")) if str(folder) not in ("", ".") else []
    if not shards:
        return 0, 0, ""
    weights = 0
    try:
        for shard in shards:
            with open(shard, "rb") as f:
                weights += shard.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    except OSError as e:
        log.debug("draft %s not counted in the wired plan: %s", folder, e)
        return 0, 0, ""
    try:
        cache = model_bytes_from_checkpoint(folder).cache_bytes(tokens, sequences)
    except (OSError, ValueError, KeyError):  # a block drafter or an mlx-lm model
        cache = 0
    return weights, cache, f" + draft {folder.name}"


def model_plan(model_dir, what: str, max_kv_size: Optional[int] = None, sequences: int = 1,
               context: Optional[int] = None, kv_bits: Optional[int] = None,
               kv_group_size: int = KV_CACHE_DEFAULT_GROUP, drafts=None) -> WiredPlan:
    """The whole model in one process (generate, chat, eval, the one-process server):
    every loaded tensor (`ModelBytes.weight_bytes`, from the shard headers) plus the
    caches of `sequences` sequences of `context` tokens (default `serving_tokens`), the
    DSA caches counted in the `--kv-bits` / `--kv-group-size` format
    (`ModelBytes.with_kv_bits`; kv_bits None: the model dtype), plus what the draft of
    `drafts` (a `speculative.settings.DraftSettings`, or None) adds (`draft_bytes`).

    Raises FileNotFoundError / CheckpointError as `model_bytes_from_checkpoint`;
    ValueError for a cache format `layer_bytes.kv_token_bytes` refuses."""
    mb = model_bytes_from_checkpoint(Path(model_dir)).with_kv_bits(kv_bits or None, kv_group_size)
    tokens = context if context is not None else serving_tokens(mb.max_position_embeddings, max_kv_size)
    dw, dc, dnote = draft_bytes(drafts, mb, tokens, sequences)
    return WiredPlan(what, mb.weight_bytes + dw, mb.cache_bytes(tokens, sequences) + dc,
                     f"{tokens} tokens x {sequences} sequence(s)"
                     + _kv_note(kv_bits, kv_group_size) + dnote)


def stage_plan(model_dir, start: int, end: int, what: str, context: Optional[int] = None,
               sequences: int = 1, kv_bits: Optional[int] = None,
               kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> WiredPlan:
    """A pipeline stage holding layers [start, end): their weights, the embedding on the
    stage holding layer 0, norm / output mix / lm_head on the one holding the last layer
    (the planner's `_Costs.weights`), plus their caches at `context` tokens (default the
    trained context) x `sequences`, DSA caches in the `kv_bits` / `kv_group_size` format
    (`ModelBytes.with_kv_bits`; None: the model dtype). ValueError: a format refused."""
    mb = model_bytes_from_checkpoint(Path(model_dir)).with_kv_bits(kv_bits or None, kv_group_size)
    layers = mb.layers[start:end]
    weights = sum(l.weight_bytes for l in layers)
    weights += mb.embed_bytes if start == 0 else 0
    weights += mb.head_bytes if end == len(mb.layers) else 0
    tokens = context or mb.max_position_embeddings
    cache = sum(l.cache_bytes(tokens, sequences) for l in layers)
    return WiredPlan(what, weights, cache,
                     f"{tokens} tokens x {sequences} sequence(s) for layers [{start}, {end})"
                     + _kv_note(kv_bits, kv_group_size))


def rank_plan(model_dir, ranks: int, rank: int, what: str, context: Optional[int] = None,
              sequences: int = 1, kv_bits: Optional[int] = None,
              kv_group_size: int = KV_CACHE_DEFAULT_GROUP) -> WiredPlan:
    """Tensor rank `rank` of `ranks`: its slices (`tensor_parallel.rank_load_bytes`, what
    `checkpoint.ranged.load_sharded` reads) plus its caches: its share of the KDA heads'
    states and the DSA / MLA caches whole (replicated on every rank), at `context` tokens
    (default the trained context) x `sequences`, the DSA caches in the `kv_bits` /
    `kv_group_size` format (`layer_bytes.cache_bytes`; None: the model dtype).
    ValueError: a format refused."""
    from kimi_mlx.model.shard import split_range
    from kimi_mlx.placement.tensor_parallel import rank_load_bytes, tensors_of

    args, tensors = tensors_of(str(model_dir))
    weights = rank_load_bytes(tensors, args, ranks, rank)
    tokens = context or args.max_position_embeddings
    heads = args.linear_attn_config["num_heads"]
    a, b = split_range(heads, ranks, rank)
    cache = 0
    for i in range(args.num_hidden_layers):
        per_token, _, state = layer_cache_bytes(args, i, kv_bits=kv_bits or None,
                                                kv_group_size=kv_group_size)
        cache += sequences * (state * (b - a) // heads + per_token * tokens)
    return WiredPlan(what, weights, cache, f"{tokens} tokens x {sequences} sequence(s)"
                     + _kv_note(kv_bits, kv_group_size))


# -- the flag ----------------------------------------------------------------------------

def add_allow_paging_argument(p) -> None:
    """`--allow-paging` on an argparse parser."""
    p.add_argument("--allow-paging", action="store_true",
                   help="start even when the weights and planned cache exceed this Mac's GPU "
                        f"working set (paged: slow); also {ALLOW_PAGING_ENV}=1")


def allow_paging(flag: bool = False) -> bool:
    """Whether paging is allowed: `flag` (a command's --allow-paging) or
    KIMI_MLX_ALLOW_PAGING=1. A set flag is exported to the environment so that the
    processes this one starts (a node's tensor ranks) inherit it."""
    if flag:
        os.environ[ALLOW_PAGING_ENV] = "1"
        return True
    return os.environ.get(ALLOW_PAGING_ENV, "").lower() in ("1", "true", "yes", "on")


# -- setting and restoring ---------------------------------------------------------------

_lock = threading.Lock()
_saved: Optional[int] = None  # the limit before this process first set one
_registered = False


def _device_info() -> dict:
    fn = getattr(mx, "device_info", None) or mx.metal.device_info
    return dict(fn())


def _set_limit(limit: int) -> int:
    fn = getattr(mx, "set_wired_limit", None) or mx.metal.set_wired_limit
    return int(fn(int(limit)))


def wire(plan: Union[WiredPlan, Callable[[], WiredPlan]],
         allow: Optional[bool] = None) -> Optional[int]:
    """Set MLX's wired limit to `WiredPlan.total_bytes` of `plan` before loading; restored at exit.

    Args:
        plan: what this process will hold, or a function returning it (called only on
            Metal: nothing is read from the checkpoint elsewhere).
        allow: go on paged when the plan exceeds the working set (None: `allow_paging()`).
    Returns:
        the limit set (bytes), or None where there is no Metal device (a no-op, logged
        at debug level), it reports no recommended working set, or the plan could not be
        made (logged as a warning; loading then says what is wrong with the checkpoint).
    Raises:
        WiredLimitError: the plan exceeds `max_recommended_working_set_size` and paging is
            not allowed; one line with the sizes and the sysctl to run.
    """
    global _saved, _registered
    if not mx.metal.is_available():
        log.debug("%s: no Metal device here (%s): MLX's wired limit is not set",
                  getattr(plan, "what", "this process"), sys.platform)
        return None
    if callable(plan):
        try:
            plan = plan()
        except (OSError, ValueError, KeyError) as e:  # CheckpointError, ConfigError: a ValueError
            log.warning("wired limit not set: cannot size this process's weights (%s)", e)
            return None
    info = _device_info()
    max_rec = int(info.get("max_recommended_working_set_size") or 0)
    if max_rec <= 0:
        log.debug("%s: the device reports no recommended working set: wired limit not set",
                  plan.what)
        return None
    need = plan.total_bytes
    limit = need
    if need > max_rec:
        n = limit_mb_for(need)
        ram = int(info.get("memory_size") or 0)
        past = (f"; that is more than this Mac's {size(ram)} of RAM: use more nodes or "
                "a pruned build (`kimi-mlx plan`)" if ram and n * MiB > ram else "")
        # the callers put the process's name in front (the command, the rank, the stage)
        line = (f"{size(need)} to wire ({plan.describe()}) is more than this Mac's GPU "
                f"working set of {size(max_rec)}: run `sudo sysctl iogpu.wired_limit_mb={n}`"
                f"{past} (or pass --allow-paging to run paged and slow)")
        if not (allow_paging() if allow is None else allow):
            raise WiredLimitError(line)
        log.warning("%s: %s; going on paged (--allow-paging): wired up to %d MiB", plan.what,
                    line, max_rec // MiB)
        limit = max_rec
    with _lock:
        old = _set_limit(limit)
        if _saved is None:
            _saved = old
        if not _registered:
            atexit.register(restore)
            _registered = True
    log.info("%s: wired limit %d MiB (%s)", plan.what, limit // MiB, plan.describe())
    return limit


def restore() -> None:
    """Put back the wired limit this process had before `wire` (after its queued GPU
    work, as `mlx_lm.generate.wired_limit` does); nothing when `wire` set none."""
    global _saved
    with _lock:
        if _saved is None:
            return
        try:
            mx.synchronize()
        except Exception:  # no stream to wait for at exit
            pass
        _set_limit(_saved)
        _saved = None

"""Batched decode through a tensor group: mlx-lm's `BatchGenerator`
(the one-process server's continuous batching, `server.batch.run_batched`) runs on rank
0's request path over `GroupRows`, a stand-in model whose caches (`RowCache`) are handles
to caches that live on every rank.

Every cache operation the generator does on a stand-in (merge single-sequence caches into
a batch, extend a batch with new rows, filter rows out, copy, prepare / finalize a
right-padded prefill chunk, extract a row) and every forward pass (a [B, L] token matrix,
padding included) becomes one group command (`step.command`: the op, then its int32
words); each rank does the same operation on its own shard's caches (`RowCaches.apply`),
so the ranks hold the same rows in the same order as rank 0's generator. One forward
command runs all rows of a step: one all_sum per layer for the whole batch. Sampling,
stop rules, snapshots' timing and admission stay with the generator on rank 0, so greedy
output of each row is what the one-process batched server computes (and a B = 1 row is
the single run).

Handles are numbered by rank 0 (never reused); a stand-in that is dropped (filtered out,
merged, extracted for a snapshot) is freed on every rank with the next command (FREE,
`weakref.finalize`). Prompt cache per row: ROW_RESTORE begins a row from the longest of
the offered snapshot keys every rank holds (`prompt_cache.agree_restore`), ROW_SNAPSHOT
has every rank keep its shard of a (single-sequence, extracted) row under rank 0's key.
Images: a row's prefill chunks that hold image pads carry the projector rows (MEDIA), as
the one-request path does.

Words of each op (int32, after the command header):
    ROW_NEW [h]                       a fresh cache (`make_prompt_cache`) as handle h
    ROW_RESTORE [h, keys...]          agreed restore into h; answers the positions
    ROW_MERGE [h, src...]             h = merge of the single caches src (dropped)
    ROW_EXTEND [a, b]                 a.extend(b); b dropped
    ROW_FILTER [a, keep...]           a.filter(keep)
    ROW_COPY [h, a]                   h = deep copy of a
    ROW_PREPARE [a, B, lengths(B), right_padding(B)]
    ROW_FINALIZE [a]
    ROW_EXTRACT [h, a, i]             h = row i of a (a single-sequence cache)
    ROW_FORWARD [a, B, L, tokens(B*L)]  flags LOGITS: answers logits [B, L, vocab]
    ROW_FREE [h...]
    ROW_SNAPSHOT [h, key]             keep h in this rank's snapshot store under key
    ROW_VERIFY [a]                    begin a verify step on batch a (KDA records,
                                      `rollback.begin_verify`): its next forward answers logits
    ROW_ROLLBACK [a, B, n_keep(B)]    row b of a keeps n_keep[b] of the verify tokens
                                      (`rollback.rollback_rows`), the records dropped

The verify pair is how a batched speculative step (`speculative.batch`, n-gram drafts for
every row) runs through the group: rank 0's generator decides each row's accepted count
from the logits and every rank rolls its own shard of the rows back by it.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

(OP_ROW_NEW, OP_ROW_RESTORE, OP_ROW_MERGE, OP_ROW_EXTEND, OP_ROW_FILTER, OP_ROW_COPY,
 OP_ROW_PREPARE, OP_ROW_FINALIZE, OP_ROW_EXTRACT, OP_ROW_FORWARD, OP_ROW_FREE,
 OP_ROW_SNAPSHOT, OP_ROW_VERIFY, OP_ROW_ROLLBACK) = range(16, 30)
ROW_OPS = frozenset(range(16, 30))

__all__ = ["ROW_OPS", "RowCaches", "RowCache", "GroupRows"]


class RowCaches:
    """One rank's caches of the batched rows, by handle (module doc), and its prompt-cache
    store (`KeyedSnapshotCache` or None)."""

    def __init__(self, model, store=None, rank: int = 0):
        self.model, self.store, self.rank = model, store, rank
        self.caches: Dict[int, List[Any]] = {}
        self.verifying: Dict[int, Any] = {}  # handle -> its open verify (`rollback.Verify`)

    def _get(self, h: int) -> List[Any]:
        try:
            return self.caches[h]
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: no batched cache {h} (rank 0 and this rank "
                               "disagree: another kimi-mlx version?)") from None

    def apply(self, op: int, w: Sequence[int], flags: int = 0, group=None, media=None):
        """Do op with words `w` (module doc) on this rank's caches. Returns the logits
        [B, L, vocab] of a ROW_FORWARD with LOGITS, the positions restored of a
        ROW_RESTORE (int), else None. Raises what the model or the collectives raise."""
        from mlx_lm.models.cache import make_prompt_cache

        from kimi_mlx.cluster.tensor.wire import LOGITS, MEDIA

        c = self.caches
        if op == OP_ROW_NEW:
            c[w[0]] = make_prompt_cache(self.model)
        elif op == OP_ROW_RESTORE:
            from kimi_mlx.cluster.tensor.prompt_cache import agree_restore, decode_keys

            cache, n = agree_restore(self.store, decode_keys(w[1:]), group)
            c[w[0]] = cache if cache is not None else make_prompt_cache(self.model)
            return int(n)
        elif op == OP_ROW_MERGE:
            srcs = [self._get(h) for h in w[1:]]
            c[w[0]] = [srcs[0][i].merge([s[i] for s in srcs]) for i in range(len(srcs[0]))]
            for h in w[1:]:
                c.pop(h, None)
        elif op == OP_ROW_EXTEND:
            for a, b in zip(self._get(w[0]), self._get(w[1])):
                a.extend(b)
            c.pop(w[1], None)
        elif op == OP_ROW_FILTER:
            keep = list(w[1:])
            for x in self._get(w[0]):
                x.filter(keep)
        elif op == OP_ROW_COPY:
            c[w[0]] = copy.deepcopy(self._get(w[1]))
        elif op == OP_ROW_PREPARE:
            B = w[1]
            lengths, pad = list(w[2:2 + B]), list(w[2 + B:2 + 2 * B])
            for x in self._get(w[0]):
                x.prepare(lengths=lengths, right_padding=pad)
        elif op == OP_ROW_FINALIZE:
            for x in self._get(w[0]):
                x.finalize()
            mx.eval([x.state for x in c[w[0]]])
        elif op == OP_ROW_EXTRACT:
            c[w[0]] = [x.extract(int(w[2])) for x in self._get(w[1])]
        elif op == OP_ROW_FORWARD:
            cache = self._get(w[0])
            B, L = w[1], w[2]
            x = mx.array(list(w[3:3 + B * L]), mx.uint32).reshape(B, L)
            if flags & MEDIA:
                from kimi_mlx.cluster.tensor.wire import _media

                pad, rows = _media(group, media)
                emb = self.model.embed_with_media(x[0], rows, pad)
                out = self.model(x, cache=cache, input_embeddings=emb[None])
            else:
                out = self.model(x, cache=cache)
            if flags & LOGITS:
                mx.eval(out, [x.state for x in cache])
                return out
            mx.eval([x.state for x in cache])
        elif op == OP_ROW_FREE:
            for h in w:
                c.pop(h, None)
        elif op == OP_ROW_SNAPSHOT:
            self._snapshot(w)
        elif op == OP_ROW_VERIFY:
            from kimi_mlx.speculative.rollback import begin_verify

            self.verifying[w[0]] = begin_verify(self._get(w[0]))
        elif op == OP_ROW_ROLLBACK:
            from kimi_mlx.speculative.rollback import end_verify, rollback_rows

            cache, verify = self._get(w[0]), self.verifying.pop(w[0], None)
            try:
                if verify is not None and w[1]:
                    rollback_rows(cache, verify, list(w[2:2 + w[1]]))
                    mx.eval([x.state for x in cache])
            finally:
                end_verify(cache)
        else:
            raise RuntimeError(f"unknown batched command {op} from rank 0 (another kimi-mlx "
                               "version?)")
        return None

    def _snapshot(self, w: Sequence[int]) -> None:
        from kimi_mlx.cluster.net.cache_keys import key_length
        from kimi_mlx.cluster.tensor.prompt_cache import decode_keys

        (key,) = decode_keys(w[1:])
        if self.store is None:
            return
        try:
            self.store.store(key, key_length(key), self._get(w[0]))
        except Exception as e:  # noqa: BLE001 - a miss later, never a wrong state
            print(f"[tensor] rank {self.rank}: prompt-cache snapshot {key} not kept: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)


class RowCache:
    """Rank 0's stand-in for one cache (all layers) of the batched rows: a handle to the
    caches every rank holds (`RowCaches`). Its methods are the batch-cache methods mlx-lm's
    generator calls (merge, extend, filter, prepare, finalize, extract, deep copy); each
    sends one command. `state` is empty (the ranks evaluate their caches themselves)."""

    def __init__(self, rows: "GroupRows", handle: int, epoch: int):
        self.rows, self.handle, self.epoch = rows, handle, epoch
        weakref.finalize(self, rows._dropped, handle, epoch)

    state: list = []
    nbytes = 0

    def is_trimmable(self) -> bool:
        return False

    def merge(self, caches: Sequence["RowCache"]) -> "RowCache":
        return self.rows._new(OP_ROW_MERGE, [c._h() for c in caches], self.epoch)

    def extend(self, other: "RowCache") -> None:
        self.rows._send(OP_ROW_EXTEND, [self._h(), other._h()], epoch=self.epoch)

    def filter(self, keep) -> None:
        keep = keep.tolist() if isinstance(keep, mx.array) else [int(i) for i in keep]
        self.rows._send(OP_ROW_FILTER, [self._h()] + keep, epoch=self.epoch)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None or lengths is None or right_padding is None:
            raise NotImplementedError("the tensor group's batched rows take right padding "
                                      "with lengths only")
        self.rows._send(OP_ROW_PREPARE, [self._h(), len(lengths)] + [int(n) for n in lengths]
                        + [int(p) for p in right_padding], epoch=self.epoch)

    def finalize(self) -> None:
        self.rows._send(OP_ROW_FINALIZE, [self._h()], epoch=self.epoch)

    def extract(self, idx: int) -> "RowCache":
        return self.rows._new(OP_ROW_EXTRACT, [self._h(), int(idx)], self.epoch)

    # the batched verify step (`speculative.batch`): begin, forward (logits), rollback
    verifying = False

    def begin_verify_rows(self) -> None:
        self.rows._send(OP_ROW_VERIFY, [self._h()], epoch=self.epoch)
        self.verifying = True

    def rollback_rows(self, n_keep: Sequence[int]) -> None:
        self.verifying = False
        self.rows._send(OP_ROW_ROLLBACK, [self._h(), len(n_keep)] + [int(n) for n in n_keep],
                        epoch=self.epoch)

    def end_verify_rows(self) -> None:
        """After a verify whose rollback was never sent (its forward failed): the ranks
        drop the records with an empty rollback."""
        if self.verifying:
            self.verifying = False
            try:
                self.rows._send(OP_ROW_ROLLBACK, [self._h(), 0], epoch=self.epoch)
            except Exception:  # noqa: BLE001 - the group is gone: nothing left to drop
                pass

    def __deepcopy__(self, memo) -> "RowCache":
        return self.rows._new(OP_ROW_COPY, [self._h()], self.epoch)

    def _h(self) -> int:
        if self.epoch != self.rows.epoch:
            raise RuntimeError("the tensor group was formed again: this request's caches "
                               "went with the old group")
        return self.handle


class GroupRows:
    """Rank 0's stand-in model for the batched rows (module doc): called like a model on
    tokens [B, L] with cache [RowCache], it commands the group's forward pass over those
    rows and runs its own share; returns logits [B, L, vocab] when L == 1 (a decode step)
    or `logits` is set or a verify step is open on the cache, else None (a prefill chunk: the generator ignores it).

    Args:
        model: rank 0's sharded model (in this process; None when `group` is a
            `relay.Rank0Process`, whose child holds it and its caches).
        group: the MLX group (this process rank 0) or a `relay.Rank0Process`.
        store: rank 0's `KeyedSnapshotCache` when in this process, else None.
        on_error: called with a collective's exception; returns the exception to raise
            instead (the engine's: naming the lost rank), or None to raise it as it is.
    """

    def __init__(self, model, group, store=None, on_error=None):
        self.on_error = on_error
        self.epoch = 0
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one command at a time; `bind` waits for it
        self._freed: List[int] = []
        self._next = 0
        self.bind(model, group, store)

    def bind(self, model, group, store=None) -> None:
        """Use `group` from now on (a group formed again): handles of the old one are dead
        (their stand-ins raise); numbering goes on."""
        with self._io:
            self.epoch += 1
            self.model, self.group = model, group
            self.args = getattr(model, "args", None)
            relay = hasattr(group, "relay_command")
            self._local = None if relay else RowCaches(model, store, 0)
            with self._lock:
                self._freed = []

    # -- the model API the generator uses ---------------------------------------------
    def make_cache(self) -> List[RowCache]:
        return [self.new_row()]

    def __call__(self, inputs: mx.array, cache=None, logits: bool = False, media=None, **kw):
        from kimi_mlx.cluster.tensor.wire import LOGITS, MEDIA

        if not cache or not isinstance(cache[0], RowCache):
            raise ValueError("the tensor group's batched model runs on its own caches "
                             "(`GroupRows.make_cache`)")
        if inputs.ndim == 1:
            inputs = inputs[None]
        B, L = inputs.shape
        flags = ((LOGITS if (L == 1 or logits or cache[0].verifying) else 0)
                 | (MEDIA if media is not None else 0))
        words = [cache[0]._h(), B, L] + [int(t) for t in inputs.reshape(-1).tolist()]
        return self._send(OP_ROW_FORWARD, words, flags, media, epoch=cache[0].epoch)

    # -- rows ----------------------------------------------------------------------------
    def new_row(self) -> RowCache:
        """A fresh single-sequence cache on every rank."""
        return self._new(OP_ROW_NEW, [])

    def restore_row(self, keys: Sequence[str]):
        """(RowCache, positions): a single-sequence cache begun from the longest of `keys`
        (`prefix_key`s, longest first) every rank holds, else fresh (0)."""
        from kimi_mlx.cluster.tensor.prompt_cache import encode_keys

        h, epoch = self._handle(), self.epoch
        n = self._send(OP_ROW_RESTORE, [h] + encode_keys(keys), epoch=epoch)
        return RowCache(self, h, epoch), int(n or 0)

    def snapshot_row(self, row: RowCache, key: str) -> None:
        """Every rank keeps its shard of single-sequence cache `row` under `key`."""
        from kimi_mlx.cluster.tensor.prompt_cache import encode_keys

        self._send(OP_ROW_SNAPSHOT, [row._h()] + encode_keys([key]), epoch=row.epoch)

    # -- commands ------------------------------------------------------------------------
    def _handle(self) -> int:
        with self._lock:
            self._next += 1
            if self._next >= 1 << 30:
                self._next = 1
            return self._next

    def _new(self, op: int, words: Sequence[int], epoch: Optional[int] = None) -> RowCache:
        h, epoch = self._handle(), self.epoch if epoch is None else epoch
        self._send(op, [h] + list(words), epoch=epoch)
        return RowCache(self, h, epoch)

    def _dropped(self, handle: int, epoch: int) -> None:
        with self._lock:
            if epoch == self.epoch:
                self._freed.append(handle)

    def _send(self, op: int, words: Sequence[int], flags: int = 0, media=None,
              epoch: Optional[int] = None):
        """One command (after a FREE of the dropped handles); `epoch`: the group the
        handles in `words` belong to (RuntimeError when it was formed again since)."""
        from kimi_mlx.cluster.tensor.wire import command

        try:
            with self._io:
                if epoch is not None and epoch != self.epoch:
                    raise RuntimeError("the tensor group was formed again: this request's "
                                       "caches went with the old group")
                with self._lock:
                    freed, self._freed = self._freed, []
                if freed:
                    self._one(command, OP_ROW_FREE, freed, 0, None)
                return self._one(command, op, words, flags, media)
        except Exception as e:
            other = self.on_error(e) if self.on_error is not None else None
            if other is not None:
                raise other from e
            raise

    def _one(self, command, op, words, flags, media):
        command(self.group, op, words, -1, flags, media)
        if self._local is None:
            return self.group.last  # the child did rank 0's share (`relay`)
        return self._local.apply(op, list(words), flags, self.group, media)

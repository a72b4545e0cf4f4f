"""The tensor group's command wire: one command from rank 0 to every rank as
an all_sum to which only rank 0 contributes — [op, T, keep, flags, up to `INLINE` token
ids] int32, longer inputs in a second broadcast, image rows (MEDIA) after it. The op
codes and flags are shared by the one-request path (`tensor.step`) and the batched rows
(`tensor.rows`, ops 16..29), which both send and follow commands through here.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

OP_EXIT, OP_BEGIN, OP_FORWARD, OP_END, OP_RESTORE, OP_SNAPSHOT = 0, 1, 2, 3, 4, 5
# flags: record for rollback (a verify step), compute the logits, image rows follow
RECORD, LOGITS, MEDIA = 1, 2, 4
# rank 0 captures hidden states (a block drafter): every rank evaluates the whole layer
# stack, so that the ranks run the same all_sums (in a prefill chunk a rank would
# otherwise skip the last layer's MLP, whose output feeds nothing but the logits)
HIDDEN = 8
INLINE = 12  # token ids carried in the command itself
HEADER = 4


def broadcast(x: mx.array, group) -> mx.array:
    """Rank 0's `x` on every rank (all_sum of x on rank 0 and zeros elsewhere; int32)."""
    return mx.distributed.all_sum(x if group.rank() == 0 else mx.zeros_like(x), group=group)


def command(group, op: int = OP_EXIT, tokens: Sequence[int] = (), keep: int = -1,
            flags: int = 0, media=None, capture=None):
    """Send (rank 0) or receive (others) one command: returns (op, token ids, keep, flags).
    `group` may be a `tensor.relay.Rank0Process` (rank 0 in a child process: the server's
    groups), which sends it and does rank 0's share there; `media` (pad id, rows [n,
    hidden]) then travels with a MEDIA command (in-process, rank 0's `_Runner.forward`
    broadcasts it after the command; ignored here), and `capture` (the layer ids of a
    HIDDEN command, whose hidden states the child returns; rank 0 in-process captures
    them itself, the other ranks need only the flag: ignored here)."""
    if hasattr(group, "relay_command"):
        return group.relay_command(op, tokens, keep, flags, media, capture)
    tokens = [int(t) for t in tokens]
    T = len(tokens)
    buf = [op, T, keep, flags] + tokens[:INLINE] + [0] * (INLINE - min(T, INLINE))
    got = broadcast(mx.array(buf, mx.int32), group).tolist()
    op, T, keep, flags = got[:HEADER]
    ids = got[HEADER:HEADER + min(T, INLINE)]
    if T > INLINE:
        rest = tokens[INLINE:] if group.rank() == 0 else [0] * (T - INLINE)
        ids += broadcast(mx.array(rest, mx.int32), group).tolist()
    return op, ids, keep, flags


def _media(group, media=None):
    """(pad id, rows float32 [n, hidden]) on every rank: rank 0's `media` (pad id, rows
    [n, hidden]) in two broadcasts (the shape, then the rows); ranks 1.. pass None."""
    if group.rank() == 0:
        pad, rows = media
        rows = rows.astype(mx.float32)
        head = [int(pad), int(rows.shape[0]), int(rows.shape[1])]
    head = broadcast(mx.array(head if group.rank() == 0 else [0, 0, 0], mx.int32), group).tolist()
    pad, n, hidden = head
    if group.rank() != 0:
        rows = mx.zeros((n, hidden), mx.float32)
    return pad, broadcast(rows, group)

"""The tensor group's command wire: one command from rank 0 to every rank as
an all_sum to which only rank 0 contributes — [op, T, keep, flags, up to `INLINE` token
ids] int32, longer inputs in a second broadcast, image rows (MEDIA) after it. The op
codes and flags are shared by the one-request path (`tensor.step`) and the batched rows
(`tensor.rows`, ops 16..29), which both send and follow commands through here.

Idle ranks sleep (PARK). A rank waiting in MLX's ring `all_sum` spins on its sockets (a
whole core per rank, measured by `kimi_mlx.testing.idle`), so a group that waits for its
next command must not wait there. `park(group, host)` on rank 0 sends PARK: every other
rank then blocks in `recv` on a plain TCP socket to rank 0 (the group's doorbell, opened
at the first PARK: rank 0 listens on `host`, its own address in the group, and the PARK
command carries the port and a random token the ranks send back), and rank 0's next
`command` first writes one byte to each doorbell socket, then broadcasts as before. Both
sides know the state from the command stream itself (after PARK: parked until the next
command), so nothing else is exchanged and a group whose rank 0 never parks runs as
before. A rank that cannot reach the doorbell (a firewall) leaves the group waiting in
`all_sum` as before (warned once). The doorbell closing (rank 0 gone) ends a parked rank
with RuntimeError, as a lost peer ends a collective.

What a wake costs (measured by `kimi_mlx.testing.idle --compare`): with
KIMI_MLX_WAKE_LOG=FILE in their environment, rank 0 notes `time.monotonic_ns()` and a
sequence number each time it rings, and every other rank, for the same sequence number,
when its blocking `recv` returned and when it re-entered the collective (the broadcast of
the command that rang). The notes are kept in memory and appended to FILE (one JSON line
each) only when the process parks again, so nothing is written between the ring and the
collective and nothing at all happens without the variable; the steps of a request never
pass here. The stamps compare only between processes of one machine (one monotonic
clock: loopback groups, as the idle tool runs).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import time
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

log = logging.getLogger(__name__)

OP_EXIT, OP_BEGIN, OP_FORWARD, OP_END, OP_RESTORE, OP_SNAPSHOT = 0, 1, 2, 3, 4, 5
OP_PARK = 6  # the other ranks wait on the doorbell until rank 0's next command (module doc)
# seconds rank 0 waits for every other rank to connect to its doorbell at the first PARK
DOORBELL_CONNECT_S = 30.0
# flags: record for rollback (a verify step), compute the logits, image rows follow
RECORD, LOGITS, MEDIA = 1, 2, 4
# rank 0 captures hidden states (a block drafter): every rank evaluates the whole layer
# stack, so that the ranks run the same all_sums (in a prefill chunk a rank would
# otherwise skip the last layer's MLP, whose output feeds nothing but the logits)
HIDDEN = 8
INLINE = 12  # token ids carried in the command itself
HEADER = 4
WAKE_LOG_ENV = "KIMI_MLX_WAKE_LOG"  # where the wake notes go (module doc); unset: none
_wake_log: Optional[str] = os.environ.get(WAKE_LOG_ENV) or None
_wake_notes: List[dict] = []  # not yet written to _wake_log


def _note_wake(record: dict) -> None:
    if _wake_log is not None:
        _wake_notes.append(record)


def _write_wake_notes() -> None:
    """Append the notes taken since the last park to `_wake_log` (called as the process
    parks: idle, off every command's path); a file that cannot be written is warned once
    and dropped."""
    global _wake_log
    if _wake_log is None or not _wake_notes:
        return
    data = "".join(json.dumps(r) + "\n" for r in _wake_notes).encode()
    _wake_notes.clear()
    try:
        fd = os.open(_wake_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)  # one append: lines of several processes never interleave
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("%s=%s: cannot write the wake notes (%s): no more notes", WAKE_LOG_ENV,
                    _wake_log, e)
        _wake_log = None


def broadcast(x: mx.array, group) -> mx.array:
    """Rank 0's `x` on every rank (all_sum of x on rank 0 and zeros elsewhere; int32)."""
    return mx.distributed.all_sum(x if group.rank() == 0 else mx.zeros_like(x), group=group)


class _Doorbell:
    """One group's doorbell (module doc): on rank 0 the listening socket and one
    connection per other rank; on the others the connection to rank 0. `parked`: the
    group waits for rank 0's next command on it."""

    def __init__(self):
        self.parked = False
        self.listener: Optional[socket.socket] = None
        self.token = 0
        self.peers: List[socket.socket] = []  # rank 0: one per other rank
        self.sock: Optional[socket.socket] = None  # ranks 1..N-1: to rank 0
        self.off = False  # it could not be opened: the group waits in all_sum, as before
        self.woken = False  # ranks 1..: rank 0 rang this doorbell at least once
        self.rings = 0  # rings sent (rank 0) / received (the others): the notes' sequence
        self.woke_ns = 0  # ranks 1..: when the last ring's recv returned (with a wake log)

    def accept(self, n: int, timeout: float) -> List[int]:
        """Rank 0: accept the `n` other ranks (each sends the token and its rank); returns
        the ranks missing after `timeout` s."""
        import time

        deadline, seen = time.monotonic() + timeout, set()
        while len(seen) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return sorted(set(range(1, n + 1)) - seen)
            self.listener.settimeout(left)
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            try:
                conn.settimeout(max(1.0, left))
                token, rank = struct.unpack("<qi", _recv_exact(conn, 12))
            except (OSError, ValueError, struct.error):
                conn.close()
                continue
            if token != self.token or rank in seen or not 0 < rank <= n:
                conn.close()  # not one of this group's ranks
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            seen.add(rank)
            self.peers.append(conn)
        return []

    def ring(self) -> None:
        """Rank 0: wake every parked rank (a lost one fails the collective that follows)."""
        self.parked = False
        self.rings += 1
        if _wake_log is not None:
            _note_wake({"ring": self.rings, "pid": os.getpid(), "rang_ns": time.monotonic_ns()})
        for c in self.peers:
            try:
                c.sendall(b"\x01")
            except OSError:
                pass

    def wait(self) -> None:
        """Ranks 1..: sleep until rank 0 rings; RuntimeError when it closed the doorbell."""
        try:
            got = self.sock.recv(1)
        except OSError as e:
            got, why = b"", str(e)
        else:
            why = "it closed the connection"
        if not got:
            raise RuntimeError(f"rank 0 is gone: its doorbell ended while this rank was idle "
                               f"({why})")
        if _wake_log is not None:
            self.woke_ns = time.monotonic_ns()
        self.rings += 1
        self.parked = False


# id(group) -> its doorbell (an MLX group lives as long as its process)
_bells: Dict[int, _Doorbell] = {}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ValueError("connection closed")
        buf += got
    return buf


def park(group, host: str) -> None:
    """Rank 0 (an MLX group, `group.rank() == 0`): send PARK, so that the other ranks wait
    for the next command asleep on the doorbell instead of spinning in `all_sum` (module
    doc). `host`: rank 0's address as the other ranks reach it (its address in the
    group's host list). The first PARK opens the doorbell (waits up to
    `DOORBELL_CONNECT_S` for every rank); when a rank cannot reach it (a firewall), the
    group never parks again and waits in `all_sum` as before (one warning). Nothing when
    already parked or in a group of one. RuntimeError: the PARK's broadcast failed (a
    peer lost), as any command's."""
    if group.size() < 2:
        return
    bell = _bells.get(id(group))
    if bell is not None and (bell.parked or bell.off):
        return
    _write_wake_notes()  # idle now: the notes of the last ring (module doc)
    words = [0] * 5
    if bell is None:
        ip = socket.gethostbyname(host)  # IPv4, as the ring's host list
        bell = _Doorbell()
        bell.listener = socket.create_server((ip, 0), backlog=group.size())
        bell.token = secrets.randbits(62)
        words = list(socket.inet_aton(ip)) + [bell.listener.getsockname()[1],
                                              bell.token >> 31, bell.token & 0x7FFFFFFF]
    command(group, OP_PARK, words)
    if bell.listener is not None:
        try:
            missing = bell.accept(group.size() - 1, DOORBELL_CONNECT_S)
        finally:
            bell.listener.close()
            bell.listener = None
        _bells[id(group)] = bell
        if missing:  # those wait in all_sum already; wake the others, never park again
            log.warning("rank(s) %s did not reach rank 0's doorbell at %s within %.0f s "
                        "(a firewall?): idle ranks of this group wait in all_sum (they spin)",
                        missing, ip, DOORBELL_CONNECT_S)
            bell.off = True
            bell.ring()
            return
    bell.parked = True


def _follow_park(group, words: Sequence[int]) -> None:
    """Ranks 1..: a PARK came; connect to rank 0's doorbell (the first one carries its
    address, port and token) and sleep until rank 0 rings."""
    bell = _bells.get(id(group))
    if bell is None:
        if len(words) < 7:
            raise RuntimeError("rank 0 parked the group without opening its doorbell")
        host = ".".join(str(int(b)) for b in words[:4])
        token = (int(words[5]) << 31) | int(words[6])
        bell = _bells[id(group)] = _Doorbell()
        try:
            sock = socket.create_connection((host, int(words[4])), timeout=DOORBELL_CONNECT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.sendall(struct.pack("<qi", token, group.rank()))
            sock.settimeout(None)
        except OSError as e:  # rank 0 gives up on this rank too: both wait in all_sum
            log.warning("rank %d: cannot reach rank 0's doorbell at %s:%d (%s): idle, this "
                        "rank waits in all_sum (it spins)", group.rank(), host, words[4], e)
            bell.off = True
            return
        bell.sock = sock
    if bell.off:
        return
    bell.parked = True
    _write_wake_notes()  # idle now: the notes of the last wake (module doc)
    try:
        bell.wait()
    except RuntimeError:
        if bell.woken:
            raise
        # never woken yet: rank 0 may have closed its doorbell before it accepted this
        # rank (it gave up after DOORBELL_CONNECT_S); all_sum says whether rank 0 is gone
        bell.off, bell.parked = True, False
        return
    bell.woken = True


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
    bell = _bells.get(id(group))
    if group.rank() == 0 and bell is not None and bell.parked:
        bell.ring()  # the other ranks wake, then meet this broadcast
    while True:
        got = _receive(group, tokens, op, keep, flags)
        if got[0] != OP_PARK or group.rank() == 0:
            return got
        _follow_park(group, got[1])  # asleep until rank 0's next command
        bell = _bells.get(id(group))
        if bell is not None and bell.woke_ns:  # a wake log: back in the collective now
            _note_wake({"ring": bell.rings, "rank": group.rank(), "pid": os.getpid(),
                        "woke_ns": bell.woke_ns, "entered_ns": time.monotonic_ns()})
            bell.woke_ns = 0


def _receive(group, tokens, op, keep, flags):
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

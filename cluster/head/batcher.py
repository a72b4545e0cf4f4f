"""Batched decode through the pipeline: one message per step for every session decoding."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Dict, Optional

from kimi_mlx.cluster.head.transport import Transport

log = logging.getLogger(__name__)


class Batcher:
    """Batched decode through the pipeline: the decode steps of the sessions in flight
    (`head.pipeline.PipelineTarget` with a batcher) go through the stages as one message per
    step (`Transport.send_rows`), which every stage runs as one batched forward pass
    (`node.runner.StageRunner.run_rows`); each session still receives its own token.

    A sender thread flushes the steps waiting once every session decoding has posted
    its step, or `wait_s` after the first one did (a session that joins, or one slower
    than the rest, then rides in the next message). Prefill stays on each session's
    own stream, so a joining request's chunks pass between decode steps.
    """

    def __init__(self, transport: Transport, wait_s: float = 0.003):
        self.t = transport
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: Dict[str, tuple] = {}
        self._members: set = set()
        self._group: Optional[str] = None
        self._seq = 0
        self._stopped = False
        self.steps = 0  # messages sent
        self.rows = 0  # decode positions they carried
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batcher")
        self._thread.start()

    def join(self, sid: str) -> None:
        with self._cond:
            self._members.add(sid)

    def leave(self, sid: str) -> None:
        with self._cond:
            self._members.discard(sid)
            self._pending.pop(sid, None)
            self._cond.notify_all()

    def step(self, sid: str, seq: int, offset: int, token: int) -> None:
        """Queue session `sid`'s next decode step (message `seq`, position `offset`)."""
        with self._cond:
            self._pending[sid] = (sid, seq, offset, int(token))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(2.0)
        if self._group is not None:
            try:
                self.t.cancel(self._group)
            except Exception as e:  # noqa: BLE001 - best effort
                log.debug("batch stream: %s", e)

    def _loop(self) -> None:
        import time

        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait(0.5)
                if self._stopped:
                    return
                end = time.monotonic() + self.wait_s
                while len(self._pending) < len(self._members) and not self._stopped:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                rows = list(self._pending.values())
                self._pending.clear()
            if rows:
                self._send(rows)

    def _send(self, rows) -> None:
        try:
            if self._group is None or self.t.stream_closed(self._group):
                if self._group is not None:
                    self.t.cancel(self._group)
                self._group, self._seq = f"b-{uuid.uuid4().hex[:16]}", 0
                self.t.open_batch(self._group)
            self.t.send_rows(self._group, self._seq, rows)
            self._seq += 1
            self.steps += 1
            self.rows += len(rows)
        except Exception as e:  # noqa: BLE001 - each waiting session hears of it
            log.warning("batched decode step failed: %s", e)
            for r in rows:
                self.t.notify_error(r[0], f"batched decode step failed: {type(e).__name__}: {e}")

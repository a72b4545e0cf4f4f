"""A stage's live sessions: the state of one `Forward` stream, its link to the next stage,
and a head's `Watch` queue (`node.service`)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc

from kimi_mlx.cluster.node.runner import Refused, Session


class DownstreamLost(RuntimeError):
    """The next stage failed, refused, or stopped accepting messages."""


class SessionLimit(Refused):
    """The session table is full (answered with RESOURCE_EXHAUSTED)."""


@dataclass
class Watcher:
    head: str
    q: "queue.Queue" = field(default_factory=queue.Queue)
    closed: bool = False


class Live:
    """A session being served: runner state + its RPC context + its downstream link."""

    def __init__(self, session: Session, context, peer: str):
        self.session = session
        self.context = context
        self.peer = peer
        self.down: Optional[Downstream] = None
        self.freed = False
        self.last_active = time.monotonic()
        self.batch = False  # a stream of batched decode steps (no state of its own)

    @property
    def id(self) -> str:
        return self.session.session


class Downstream:
    """This session's `Forward` call to the next stage (a bounded send queue, a reader);
    `service` is the `node.service.StageService` (its stubs, deadline and failure report)."""

    def __init__(self, service, live: Live, address: str):
        self.service, self.live, self.address = service, live, address
        self.q: "queue.Queue" = queue.Queue(maxsize=8)
        self.error: Optional[str] = None
        self.cancelled = False
        self.done = threading.Event()
        self.call = service.stub(address).Forward(self._requests(), timeout=service.stream_deadline)
        self.thread = threading.Thread(target=self._read, daemon=True,
                                       name=f"down-{live.id}")
        self.thread.start()

    def _requests(self):
        while True:
            m = self.q.get()
            if m is None:
                return
            yield m

    def _read(self):
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as e:
            if not self.cancelled:
                self.error = f"next stage at {self.address}: {e.code().name}: {e.details()}"
                self.service._downstream_failed(self.live, self.error)
        finally:
            self.done.set()

    def send(self, msg, timeout: float) -> None:
        """Queue `msg` for the next stage; waits (bounded) while the queue is full, and
        gives up at once when the call fails or the session ends."""
        end = time.monotonic() + timeout
        while True:
            if self.error:
                raise DownstreamLost(self.error)
            if self.cancelled or self.live.freed:
                raise DownstreamLost("session ended")
            try:
                self.q.put(msg, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() > end:
                    raise DownstreamLost(f"next stage at {self.address} accepted nothing for "
                                         f"{timeout:.0f} s") from None

    def finish(self, timeout: float) -> None:
        """End the stream normally and wait (bounded) for the next stage to close it."""
        try:
            self.q.put(None, timeout=timeout)
        except queue.Full:
            self.cancel()
            return
        if not self.done.wait(timeout):
            self.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self.call.cancel()

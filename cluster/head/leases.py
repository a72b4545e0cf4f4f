"""The head's `Watch` lease on every stage: heartbeats, the last stage's tokens and session
errors routed to their sessions, and a stage reported lost when its lease breaks or it is
silent for `peer_timeout` seconds (then probed with a `Health` call)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict

import grpc

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.control import rpc_reason

log = logging.getLogger(__name__)


class StageLeases:
    """The leases of `head.transport.GrpcTransport` (uses its stages, stubs, sessions,
    `peer_timeout`, `rpc_timeout`, `head_id` and `_failure`)."""

    def _start_watches(self) -> None:
        ready = [threading.Event() for _ in self.stages]
        self._watches = []
        self._generation += 1
        for i, stub in enumerate(self._stubs):
            call = stub.Watch(pb.WatchRequest(head=self.head_id), timeout=self.session_deadline)
            t = threading.Thread(target=self._watch, args=(i, call, ready[i], self._generation),
                                 daemon=True, name=f"watch-{i}")
            self._watches.append(call)
            t.start()
        deadline = time.monotonic() + self.peer_timeout
        for i, ev in enumerate(ready):
            if not ev.wait(max(0.0, deadline - time.monotonic())) and i not in self.lost:
                self.lost[i] = f"no heartbeat within {self.peer_timeout:.0f} s of loading"
        if self.lost:
            raise self._failure(None)

    def _watch(self, i: int, call, ready: threading.Event, generation: int) -> None:
        try:
            for ev in call:
                self._last_seen[i] = time.monotonic()
                if ev.peak_memory:
                    self._peak[i] = max(self._peak[i], ev.peak_memory)
                ready.set()
                if ev.kind in (pb.Event.TOKEN, pb.Event.ERROR):
                    s = self._sessions.get(ev.session)
                    if s is not None:
                        s.events.put(ev)
                    elif ev.kind == pb.Event.ERROR:  # about a session already ended here
                        log.info("%s", ev.message if ev.message.startswith(f"stage {i} (")
                                 else f"{self.describe(i)}: {ev.message}")
            reason = "lease ended by the stage (service stopped?)"
        except grpc.RpcError as e:
            reason = rpc_reason(e)
        if not self._closing and generation == self._generation:  # not a replaced lease
            self.lost.setdefault(i, reason)
            # INFO: the caller reports the loss (StageFailure) once, with what to do next
            log.info("%s lost: %s", self.describe(i), reason)
            self._wake_all()

    def _wake_all(self) -> None:
        for s in list(self._sessions.values()):
            s.events.put(None)

    def _drop_watches(self) -> None:
        self._generation += 1
        for call in self._watches:
            call.cancel()
        self._watches = []

    def _check_alive(self) -> None:
        if self.losses():
            raise self._failure(None)

    def losses(self) -> Dict[int, str]:
        now = time.monotonic()
        for i, t in enumerate(self._last_seen):
            if i not in self.lost and now - t > self.peer_timeout:
                self.lost[i] = (f"no heartbeat for {now - t:.1f} s (hung, or off the network)")
        return dict(self.lost)

    def _probe(self) -> None:
        def one(i):
            try:
                self._stubs[i].Health(pb.HealthRequest(), timeout=self.rpc_timeout)
            except grpc.RpcError as e:
                self.lost.setdefault(i, f"not answering: {rpc_reason(e)}")

        threads = [threading.Thread(target=one, args=(i,), daemon=True)
                   for i in range(len(self.stages)) if i not in self.lost]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.rpc_timeout + 1)

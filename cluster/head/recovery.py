"""Keep `kimi-mlx cluster server`'s pipeline serving: notice a lost stage, bring it back.

`PipelineKeeper` owns the `head.pipeline.Pipeline` the server generates through. A watch thread
asks the pipeline's transport every `interval` seconds which stages are lost
(`Transport.losses()`: a broken `Watch` lease, or heartbeats silent for the transport's
peer timeout), so a loss shows in `/health` within about `peer_timeout + interval`
seconds even when no request is running. Requests on the lost pipeline fail (their
`receive` raises `StageFailure`); nothing is retried on another placement.

Then it keeps trying, every `retry` seconds:

1. Ask the lost stages' nodes (`net.nodes.check_nodes`, an authenticated Health call) whether
   they answer with the checkpoint's fingerprint. If they all do, reconnect over the same
   nodes: the stages that survived answer "already loaded", the restarted ones load
   again ("reloading stage N on node X").
2. Else, with `--replan`: plan and load over the nodes that answer, without the lost
   ones, if the model fits there ("re-planning without node X"); a `PlanError` (does not
   fit) means wait for the node instead.
3. Else wait ("waiting for node X to answer again: <why not>").

`status()` is what `/health` reports: None while serving, else the loss and which of
these it is doing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

log = logging.getLogger(__name__)

__all__ = ["PipelineKeeper"]


class PipelineKeeper:
    """Holds the serving pipeline and recovers it (see the module doc).

    Args:
        pipeline: the loaded `head.pipeline.Pipeline`.
        reconnect: (excluded node ids) -> a new loaded Pipeline over the nodes that answer,
            without the excluded ones (raises when it cannot: the error is shown in
            /health and the keeper tries again later).
        probe: ([NodeInfo]) -> (accepted, rejected) as `net.nodes.check_nodes` with the
            checkpoint's fingerprint.
        replan: re-plan over the nodes left when a lost node does not answer.
        interval: seconds between checks while serving. retry: seconds between recovery
            attempts.
    """

    def __init__(self, pipeline, reconnect: Callable[[Set[str]], object],
                 probe: Callable[[list], Tuple[list, list]], replan: bool = False,
                 interval: float = 1.0, retry: float = 2.0):
        self.pipeline = pipeline
        self.reconnect = reconnect
        self.probe = probe
        self.replan = replan
        self.interval = interval
        self.retry = retry
        self.excluded: Set[str] = set()
        self.recoveries = 0
        self._loss: Optional[str] = None  # what was lost (kept until serving again)
        self._doing: str = ""  # what the keeper is doing about it
        self._lost_nodes: List = []  # NodeInfo of the lost stages
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipeline-keeper")

    def start(self) -> "PipelineKeeper":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def transport(self):
        return self.pipeline.transport

    def status(self) -> Optional[str]:
        """None while every stage serves; else 'stage i (...) lost: why; what now'."""
        with self._lock:
            if self._loss is None:
                return None
            return f"{self._loss}; {self._doing}" if self._doing else self._loss

    def check(self) -> Optional[str]:
        """Look at the transport now; record and return a new loss (None if serving)."""
        with self._lock:
            if self._loss is not None:
                return self._loss
        t = self.transport
        lost: Dict[int, str] = t.losses()
        if not lost:
            return None
        text = "; ".join(f"{t.describe(i)} lost: {why}" for i, why in sorted(lost.items()))
        with self._lock:
            self._loss = f"stage lost: {text}"
            self._lost_nodes = [t.stages[i].node for i in sorted(lost)]
            self._doing = "failing the requests on it"
        log.warning("%s", self._loss)
        return self._loss

    # -- the watch thread ---------------------------------------------------------------
    def _loop(self) -> None:
        next_try = 0.0
        while not self._stop.wait(self.interval):
            try:
                if self.check() is None:
                    continue
                now = time.monotonic()
                if now >= next_try:
                    self._recover()
                    next_try = time.monotonic() + self.retry
            except Exception as e:  # noqa: BLE001 - the keeper must keep watching
                log.exception("pipeline keeper")
                self._set_doing(f"recovery failed: {type(e).__name__}: {e}")

    def _set_doing(self, what: str) -> None:
        with self._lock:
            self._doing = what

    def _names(self, nodes) -> str:
        return ", ".join(f"{n.node_id} at {n.address}" for n in nodes)

    def _recover(self) -> None:
        """One attempt (see the module doc)."""
        from kimi_mlx.placement.planner import PlanError

        old = self.pipeline
        try:  # drop the old leases: every stage frees the old sessions (needed to re-plan)
            old.transport.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("shutdown: %s", e)
        lost = self._lost_nodes
        accepted, rejected = self.probe(lost)
        stages = ", ".join(str(i) for i, s in enumerate(old.transport.stages)
                           if s.node in lost)
        if not rejected:
            self._set_doing(f"reloading stage {stages} on node {self._names(lost)}")
            excluded = set(self.excluded)
        elif self.replan:
            why = "; ".join(f"{r.node_id}: {r.reason}" for r in rejected)
            gone = {r.node_id for r in rejected}
            self._set_doing(f"re-planning without node {', '.join(sorted(gone))} ({why})")
            excluded = self.excluded | gone
        else:
            why = "; ".join(f"node {r.node_id} at {r.address}: {r.reason}" for r in rejected)
            self._set_doing(f"waiting for it to answer again ({why})")
            return
        try:
            pipeline = self.reconnect(excluded)
        except (PlanError, Exception) as e:  # noqa: BLE001 - shown in /health, tried again
            self._set_doing(f"{self._doing}: failed, trying again: {type(e).__name__}: {e}")
            log.warning("pipeline recovery: %s", self._doing)
            return
        with self._lock:
            self.pipeline = pipeline
            self.excluded = excluded
            self.recoveries += 1
            log.warning("serving again after %s (%s)", self._loss, self._doing)
            self._loss, self._doing, self._lost_nodes = None, "", []

"""Keep `kimi-mlx cluster server --parallel tensor` serving: form the group again after a
loss, as `head.recovery.PipelineKeeper` does for a pipeline.

Rank 0 runs in a child process (`tensor.relay`: MLX cannot form a second group in one
process), so the server forms the group again by itself. `GroupKeeper` runs a thread
that, at once after the loss (once the request on the old group ended), then every
`retry` s, asks the lost node for its Health through the control plane (a new channel
each time, with the checkpoint's fingerprint, `net.nodes.check_nodes`); once it answers,
the group is formed again over the same nodes (new leases, a new rank 0 process on a new
port: the group's epoch goes up and nothing of the old group can reach the new one; a
late report of an old group's watch is ignored). With --replan, a lost node that does
not answer is left out and the group is formed over the nodes left, when the model loads
there (else it waits for the node). `doing` says which of these it is doing (/health).

While the group serves, the same thread notices rank 0's process ending or stopped on its
own (idle or mid-request) and starts the next group's rank 0 process `SPARE_AFTER` s after
a group formed (`relay.start_spare`): it then joins at once, before the node's new rank
first tries to connect to it (a refused try costs 1 s, then 2, 4, 8 s in MLX's ring).

The keeper reads and replaces the engine's group only through `TensorEngine.group_state`
and `TensorEngine.install`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional, Set, Tuple

log = logging.getLogger(__name__)

__all__ = ["GroupKeeper", "SPARE_AFTER"]

# seconds after a group formed before the spare rank 0 process for the next one starts
# (`tensor.relay.start_spare`): its imports then do not slow the group's first requests
SPARE_AFTER = 1.0


class GroupKeeper:
    """Forms a `tensor.engine.TensorEngine`'s group again after a loss (module doc).

    Args:
        engine: the `TensorEngine` (its `group_state`, `install`, `stopping`).
        reform: (excluded node names, epoch, cancelled) -> (transport, group, model, watch,
            ranks), a new group, given up (raising) once `cancelled()` (the server stops).
        probe: ([NodeInfo]) -> (accepted, rejected), `net.nodes.check_nodes` for the
            checkpoint.
        replan: form the group without a lost node that does not answer.
        retry: seconds between recovery attempts (and between checks of rank 0's process).
        spare: start the next group's rank 0 process ahead (rank 0 in a child process).
    """

    def __init__(self, engine, reform: Callable, probe: Callable[[list], Tuple[list, list]],
                 replan: bool = False, retry: float = 0.5, spare: bool = False):
        self.engine, self.reform, self.probe = engine, reform, probe
        self.replan, self.retry = replan, retry
        self.excluded: Set[str] = set()  # nodes left out by --replan
        self.recoveries = 0
        self._doing = ""  # what the recovery is doing (for /health)
        self._lost_nodes: List = []  # NodeInfo of the nodes whose rank was lost
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a loss: the recovery starts now, not at its next poll
        self._spare = spare
        self._spare_at: Optional[float] = None
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kimi-mlx-tensor-heal")

    def start(self) -> "GroupKeeper":
        if self._spare:
            self._spare_at = time.monotonic() + SPARE_AFTER
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (the engine is stopping) and any spare rank 0 process."""
        if self._thread.ident is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        from kimi_mlx.cluster.tensor.relay import stop_spare

        stop_spare()

    @property
    def doing(self) -> str:
        with self._lock:
            return self._doing

    def _set_doing(self, what: str) -> None:
        with self._lock:
            self._doing = what

    def lost(self, nodes: list) -> None:
        """The group was lost (`nodes`: the NodeInfo of the lost ranks' nodes, [] when rank
        0's own process ended): recover from now on."""
        with self._lock:
            self._lost_nodes = list(nodes)
            self._doing = "forming the group again when the lost node answers"
        self._wake.set()

    def wake(self) -> None:
        """Look now instead of at the next poll (the request on a lost group ended)."""
        self._wake.set()

    def _loop(self) -> None:
        """Every `retry` s (at once when woken): notice rank 0's process ending or stopped
        on its own, start the spare rank 0 process, and while the group is lost, try to
        form it again (`heal`) once no request runs on the old one."""
        engine = self.engine
        while True:
            self._wake.wait(self.retry)
            self._wake.clear()
            if engine.stopping():
                return
            try:
                lost, group, watch, busy = engine.group_state()
                if lost is None:
                    own = getattr(group, "state", lambda: None)()
                    if own is not None:
                        watch.fail(f"rank 0 (this head's rank process) {own}")
                    elif self._spare_at is not None and time.monotonic() >= self._spare_at:
                        from kimi_mlx.cluster.tensor.relay import start_spare

                        self._spare_at = None
                        start_spare()
                    continue
                if not busy:  # the request on the old group has failed and ended
                    self.heal()
            except Exception as e:  # noqa: BLE001 - the recovery must keep trying
                log.exception("tensor group recovery")
                self._set_doing(f"recovery failed, trying again: {type(e).__name__}: {e}")

    def heal(self) -> None:
        """One attempt: ask the lost node(s) for Health; all answer: form the group again
        over the same nodes; else with --replan, without them; else keep waiting."""
        engine = self.engine
        with self._lock:
            lost = list(self._lost_nodes)
        excluded = set(self.excluded)
        if lost:
            accepted, rejected = self.probe(lost)
            names = ", ".join(f"{n.node_id} at {n.address}" for n in lost)
            if not rejected:
                doing = f"forming the group again (node {names} answers)"
            elif self.replan:
                gone = {r.node_id for r in rejected}
                why = "; ".join(f"{r.node_id}: {r.reason}" for r in rejected)
                doing = f"re-forming the group without node {', '.join(sorted(gone))} ({why})"
                excluded |= gone
            else:
                why = "; ".join(f"node {r.node_id} at {r.address}: {r.reason}" for r in rejected)
                self._set_doing(f"waiting for it to answer again ({why})")
                return
        else:
            doing = "forming the group again"
        self._set_doing(doing)
        t0 = time.monotonic()
        try:
            engine.transport.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("shutdown: %s", e)
        try:
            transport, group, model, watch, ranks = self.reform(excluded, engine.epoch + 1,
                                                                engine.stopping)
        except Exception as e:  # noqa: BLE001 - shown in /health, tried again
            self._set_doing(f"{doing}: failed, trying again: {type(e).__name__}: {e}")
            log.warning("tensor group recovery: %s", self.doing)
            return
        was = engine.install(transport, group, model, watch, ranks)
        if was is None:  # the server stopped meanwhile
            return
        with self._lock:
            self.excluded = excluded
            self.recoveries += 1
            self._doing, self._lost_nodes = "", []
        if self._spare:
            self._spare_at = time.monotonic() + SPARE_AFTER
        log.warning("serving again through a tensor-parallel group of %d (epoch %d, formed in "
                    "%.1f s; rank 0 process pid %s) after %s", group.size(), engine.epoch,
                    time.monotonic() - t0, getattr(getattr(group, "proc", None), "pid", "?"), was)

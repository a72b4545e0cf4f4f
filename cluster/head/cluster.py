"""A pipeline from its head: the nodes a `net.nodes.NodeFinder` accepts, planned
(`head.plan`) and loaded (one progress bar per stage), repeatable for --replan and for
`recovery.PipelineKeeper`'s reconnects."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from kimi_mlx.cluster.head.pipeline import DEFAULT_PREFILL_CHUNK, Pipeline
from kimi_mlx.cluster.head.plan import choose_compute_dtype, plan_stages
from kimi_mlx.cluster.head.transport import GrpcTransport
from kimi_mlx.cluster.net.nodes import NodeFinder


@dataclass(frozen=True)
class PipelineSettings:
    """How the head plans and loads a pipeline (`cluster launch` / `cluster server` flags).

    sequences: concurrent sequences the caches are planned for. activation_dtype: "auto"
    or a dtype name (`head.plan.choose_compute_dtype`). wire_dtype: "same" or a dtype name.
    prefill_chunk: prompt tokens per message. force_load: replace what busy stages hold.
    quiet: no progress bars.
    """

    sequences: int = 1
    activation_dtype: str = "auto"
    wire_dtype: str = "same"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    force_load: bool = False
    quiet: bool = False


class LoadBars:
    """One tqdm progress bar per stage (stderr; on a terminal and without --quiet)."""

    def __init__(self, assignments, quiet: bool = False):
        from tqdm import tqdm

        self.lock = threading.Lock()
        self.assignments = assignments
        self.tty = sys.stderr.isatty()  # no bars in logs: one line per stage when ready
        self.bars = [tqdm(total=1, desc=f"{a.node.node_id} [{a.start},{a.end})", position=i,
                          unit="B", unit_scale=True, file=sys.stderr, leave=True,
                          dynamic_ncols=True, disable=quiet or not self.tty)
                     for i, a in enumerate(assignments)]

    def update(self, i: int, p) -> None:
        if p.phase == "ready" and not self.tty:
            disk = f", {p.disk_read_bytes / 1e6:.1f} MB read from files" if p.disk_read_bytes >= 0 else ""
            print(f"[cluster]   {self.assignments[i].describe(i)}: "
                  f"{'already loaded' if p.message == 'already loaded' else 'loaded'} "
                  f"{p.tensor_bytes / 1e6:.1f} MB of tensors in {p.seconds:.1f} s{disk}",
                  file=sys.stderr)
        with self.lock:
            b = self.bars[i]
            if p.bytes_total:
                b.total = p.bytes_total
                b.n = p.bytes_done
            if p.phase == "waiting":
                b.set_postfix_str("waiting for a load in progress")
            elif p.phase == "ready":
                b.set_postfix_str("already loaded" if p.message == "already loaded" else "ready")
            elif p.phase == "error":
                b.set_postfix_str("failed")
            b.refresh()

    def close(self) -> None:
        for b in self.bars:
            b.close()


class Cluster:
    """Discovery -> checks -> plan -> load, repeatable for --replan.

    Args:
        finder: the nodes and the checkpoint (`secret`, `model_dir`, `fp`; `excluded`
            nodes are left out of the next `connect`).
        settings: planning and loading (`PipelineSettings`).
        context: tokens per sequence the caches are planned for.

    `transport`: the `GrpcTransport` of the last `connect` (None before).
    """

    def __init__(self, finder: NodeFinder, settings: PipelineSettings, context: int):
        self.finder, self.settings, self.context = finder, settings, context
        self.transport = None

    def connect(self) -> Pipeline:
        """Check the nodes, plan, load every stage; the `Pipeline` over them. Raises
        PlanError (does not fit), StageFailure (a load failed), RuntimeError (no usable
        nodes) or ValueError, after shutting its transport down."""
        n, a, f = self.finder.settings, self.settings, self.finder
        transport = GrpcTransport(f.secret, n.tls_secret_path, peer_timeout=n.peer_timeout)
        try:
            accepted = f.accepted(transport)
        except Exception:
            transport.shutdown()
            raise
        nodes = [node for node, _ in accepted]
        try:  # in the caches' format the stages will run (--kv-bits)
            plan, assignments = plan_stages(f.model_dir, nodes, self.context, a.sequences,
                                            n.kv_bits, n.kv_group_size)
        except Exception:
            transport.shutdown()
            raise
        replies = {node.node_id: r for node, r in accepted}
        compute = choose_compute_dtype([replies[s.node.node_id] for s in assignments],
                                       f.model_dir, a.activation_dtype)
        wire = compute if a.wire_dtype == "same" else a.wire_dtype
        kv = f", {n.kv_bits}-bit caches (group {n.kv_group_size})" if n.kv_bits else ""
        print(f"[cluster] plan for {self.context} tokens x {a.sequences} sequence(s){kv}, "
              f"activations {compute} (wire {wire}):", file=sys.stderr)
        for i, s in enumerate(assignments):
            st = plan.used_stages[i]
            print(f"[cluster]   {s.describe(i)}: {st.total_bytes / 1e9:.2f} GB of "
                  f"{s.node.usable_memory / 1e9:.1f} GB usable", file=sys.stderr)
        for unused in plan.unused_nodes:
            print(f"[cluster]   node {unused.name}: not needed", file=sys.stderr)
        bars = LoadBars(assignments, quiet=a.quiet)
        try:
            transport.load(f.fp, assignments, compute, wire, progress=bars.update,
                           force=a.force_load, max_positions=self.context,
                           planned_tokens=self.context, planned_sequences=a.sequences,
                           kv=(n.kv_bits, n.kv_group_size))
        except Exception:
            transport.shutdown()
            raise
        finally:
            bars.close()
        self.transport = transport
        return Pipeline(transport, a.prefill_chunk)

    def keeper(self, pipeline: Pipeline):
        """A `recovery.PipelineKeeper` for the server's pipeline: it reconnects through
        `connect()` (discovery, checks, plan and load) with the nodes it excludes, and
        asks lost nodes for the checkpoint with `net.nodes.check_nodes`."""
        from kimi_mlx.cluster.head.recovery import PipelineKeeper
        from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
        from kimi_mlx.cluster.net.nodes import check_nodes

        finder = self.finder

        def reconnect(excluded):
            finder.excluded = set(excluded)
            return self.connect()

        def probe(nodes):
            t, channels = self.transport, []

            def stub_for(address):
                channels.append(t.channel_for(address))
                return pb_grpc.StageStub(channels[-1])

            try:
                return check_nodes(nodes, stub_for, finder.fp,
                                   check_version=finder.settings.check_version,
                                   channel_for=t.channel_for)
            finally:
                for ch in channels:
                    ch.close()

        return PipelineKeeper(pipeline, reconnect, probe, replan=finder.settings.replan)

"""Forming a tensor-parallel group from its head (`cluster launch` / `cluster server
--parallel tensor`): this head is rank 0, each node starts a rank (`node.rank`, which runs
`tensor.rank`)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import mlx.core as mx

from kimi_mlx.cluster.net import jaccl
from kimi_mlx.cluster.net.nodes import NodeFinder
from kimi_mlx.cluster.net.ranks import RANK_PORT_OFFSET, available_backends
from kimi_mlx.cluster.tensor.group import (TensorGroup, TensorSetupError, choose_backend, free_port,
                                           hosts_json, local_address_towards)


def check_fits(model_dir, accepted, context: int) -> None:
    """Raise TensorSetupError unless the checkpoint splits over this head and the
    `accepted` nodes ([(NodeInfo, HealthReply)]) and each node's slices plus its cache for
    `context` tokens fit its usable memory (`placement.tensor_parallel.tensor_plan_for`,
    as `cluster.launch.recommended` checks). For --replan: a group over fewer nodes."""
    from kimi_mlx.model.shard import ShardError
    from kimi_mlx.placement.tensor_parallel import tensor_plan_for, tensors_of

    nodes = [n.planner_node() for n, _ in accepted]
    if not nodes:
        raise TensorSetupError("no node left to form a group with")
    targs, tensors = tensors_of(str(model_dir))
    bw = [n.bandwidth_bytes_per_s for n in nodes]
    try:
        tp = tensor_plan_for(tensors, targs, bw + [min(bw)], context)
    except (ShardError, ValueError) as e:
        raise TensorSetupError(f"the model does not split over {len(nodes) + 1} ranks: "
                               f"{e}") from None
    need = max(tp.load_bytes) + tp.cache_bytes
    short = [f"node {n.name} has {n.usable_bytes / 2**30:.1f} GiB usable" for n in nodes
             if need > n.usable_bytes]
    if short:
        raise TensorSetupError(f"the model does not fit {len(nodes) + 1} ranks: a rank needs "
                               f"{need / 2**30:.1f} GiB, " + ", ".join(short))


def form_group(cluster: NodeFinder, watch: TensorGroup, backend: str = "auto",
               relay: bool = False, epoch: int = 0, check=None, cancelled=lambda: False,
               store=None, plan=(0, 0)):
    """Form the group (this head rank 0, the accepted nodes ranks 1..N, each started by its
    node's `StartRank` under `watch`) and load this head's slices.

    `cluster`: the nodes and the checkpoint (`net.nodes.NodeFinder`: its settings' secret
    file and TLS, the fingerprint and folder). `backend`: "auto", "ring" or "jaccl".
    `relay`: run rank 0 in a child process (`tensor.relay.Rank0Process`, the server's
    groups, which can be formed again after a loss); `epoch` names that group in messages.
    `check`: called with the accepted nodes before anything starts (e.g. `check_fits`).
    `cancelled`: with `relay`, give up (RuntimeError, everything closed, the host file
    removed) once it returns True while rank 0 joins and loads (a server stopping).
    `store`: with `relay`, rank 0's prompt-cache settings for its process (`Rank0Process`).
    `plan`: (tokens per sequence, sequences) every rank sizes its wired memory for (the
    head's context and the sequences it decodes together; 0: the trained context / one
    sequence), sent in each `RankRequest` and handed to rank 0.
    Returns (transport, group, model): with `relay`, group is the `Rank0Process` and model
    a stand-in carrying only the checkpoint's `args`. Raises TensorSetupError (naming the
    node), RuntimeError, ValueError or OSError after closing what it opened.
    """
    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.control import ControlClient
    from kimi_mlx.cluster.net.wire import package_versions

    transport = ControlClient(cluster.secret, cluster.settings.tls_secret_path)
    # the DSA caches' format of every rank (`--kv-bits`, `net.nodes.NodeSettings`)
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP

    kv = (getattr(cluster.settings, "kv_bits", None),
          getattr(cluster.settings, "kv_group_size", None) or KV_DEFAULT_GROUP)
    try:
        accepted = cluster.accepted(transport)
        if check is not None:
            check(accepted)
        mine = package_versions()[1]
        wrong = [f"node {n.node_id} runs MLX {r.mlx_version}" for n, r in accepted
                 if r.mlx_version != mine]
        if wrong:
            raise TensorSetupError("; ".join(wrong) + f", this head MLX {mine}: one group needs "
                                   "the same MLX on every rank")
        reports = [jaccl.NodeReport.from_json(jaccl.local_report_json("this head"), "this head")] + [
            jaccl.NodeReport.from_json(r.rdma_report, f"node {n.node_id}") if r.rdma_report
            else jaccl.NodeReport(f"node {n.node_id}", problem="its kimi-mlx sends no RDMA report")
            for n, r in accepted]
        backend = choose_backend(
            {"this head": available_backends(),
             **{f"node {n.node_id}": list(r.backends) for n, r in accepted}},
            None if backend == "auto" else backend, reports)
        me = local_address_towards(accepted[0][0].host)
        addresses = [(me, free_port(me))] + [(socket.gethostbyname(n.host), n.port + RANK_PORT_OFFSET)
                                             for n, _ in accepted]
        hosts = (jaccl.hosts_payload(jaccl.device_matrix(reports), f"{me}:{addresses[0][1]}")
                 if backend == "jaccl" else hosts_json(addresses))
        print(f"[cluster] tensor parallel, {backend} group of {len(addresses)}: rank 0 this head "
              f"({me}:{addresses[0][1]}), " + ", ".join(
                  f"rank {i + 1} node {n.node_id} ({h}:{p})"
                  for i, ((n, _), (h, p)) in enumerate(zip(accepted, addresses[1:]))),
              file=sys.stderr, flush=True)
        if backend == "jaccl":  # rank 0 is the coordinator the other ranks connect to
            group_env, hostfile = jaccl.rank_env(hosts, 0)
        elif relay:  # the host list goes to rank 0's process in a file no path names
            group_env, hostfile = dict(MLX_RANK="0"), ""
        else:
            fd, hostfile = tempfile.mkstemp(prefix="kimi-mlx-hosts-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(hosts)
            group_env = dict(MLX_RANK="0", MLX_HOSTFILE=hostfile)
        watch.nodes = {n.node_id: n for n, _ in accepted}
        if relay:  # rank 0's process (imported, `relay.Rank0Process`) joins first
            from kimi_mlx.cluster.tensor.relay import Rank0Process

            watch.rank0 = Rank0Process(cluster.model_dir, backend, group_env, epoch,
                                       hosts=None if backend == "jaccl" else hosts,
                                       store=store, cancelled=cancelled, plan=plan,
                                       kv=kv)
        try:
            watch.start([(n.node_id, transport.stub_for(n.address)) for n, _ in accepted],
                        [pb.RankRequest(fingerprint=cluster.fp, rank=i + 1, size=len(addresses),
                                        backend=backend, hosts=hosts, head=transport.head_id,
                                        planned_tokens=int(plan[0]),
                                        planned_sequences=int(plan[1]),
                                        kv_bits=kv[0] or 0, kv_group_size=kv[1])
                         for i in range(len(accepted))])
            if relay:
                return (transport,) + _relay_rank0(cluster, watch, cancelled)
        except BaseException:
            _unlink(hostfile)
            raise
        finally:
            if relay:  # the child has read it by now, or is dead
                _unlink(hostfile)
        os.environ.update(group_env)
        try:
            group = mx.distributed.init(backend=backend, strict=True)
        finally:
            os.unlink(hostfile)
        from kimi_mlx.cluster.tensor.rank import wire_rank

        wire_rank(cluster.model_dir, group, "rank 0", *plan, kv=kv)
        model, _ = load_sharded(cluster.model_dir, group)
        model.set_kv_quant(*kv)
    except BaseException:
        watch.close()
        transport.shutdown()
        raise
    return transport, group, model


def _unlink(path: str) -> None:
    if not path:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def _relay_rank0(cluster: NodeFinder, watch: TensorGroup, cancelled):
    """(Rank0Process, stand-in model) for `form_group(relay=True)` once `watch.rank0`, the
    child, joined and loaded; RuntimeError naming the failure (the watch's, when a node's
    rank failed meanwhile)."""
    from types import SimpleNamespace

    from kimi_mlx.model.config import ModelArgs, read_config

    try:
        watch.rank0.wait_ready(max(watch.peer_timeout + 5, 120.0),
                               cancelled=lambda: watch.failed is not None or cancelled())
    except RuntimeError as e:
        raise RuntimeError(watch.failed or str(e)) from None
    return watch.rank0, SimpleNamespace(args=ModelArgs.from_config(read_config(cluster.model_dir)))

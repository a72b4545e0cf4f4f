"""`cluster launch --parallel tensor`: the head's side of a tensor-parallel group (the nodes'
side is `node.rank`, the ranks' `tensor.rank`)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import List

import mlx.core as mx

from kimi_mlx.cluster.net import jaccl
from kimi_mlx.cluster.tensor.group import (RANK_PORT_OFFSET, TensorGroup, TensorSetupError,
                                     available_backends, choose_backend, free_port, hosts_json,
                                     local_address_towards)
# -- head side: `cluster launch --parallel tensor` ---------------------------------------------

def form_group(args, cluster, watch: TensorGroup):
    """Form the group (this head rank 0, the accepted nodes ranks 1..N, each started by its
    node's `StartRank` under `watch`) and load this head's slices.

    `cluster`: cluster.cli's `_Cluster` (nodes, checkpoint, secret). Returns (transport,
    group, model); raises TensorSetupError (naming the node), RuntimeError, ValueError or
    OSError after closing what it opened.
    """
    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.control import ControlClient
    from kimi_mlx.cluster.net.wire import package_versions

    transport = ControlClient(cluster.secret, args.secret_file if args.tls else None)
    try:
        accepted = cluster.accepted(transport)
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
            None if args.backend == "auto" else args.backend, reports)
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
        watch.start([(n.node_id, transport.stub_for(n.address)) for n, _ in accepted],
                    [pb.RankRequest(fingerprint=cluster.fp, rank=i + 1, size=len(addresses),
                                    backend=backend, hosts=hosts, head=transport.head_id)
                     for i in range(len(accepted))])
        if backend == "jaccl":  # rank 0 is the coordinator the other ranks connect to
            group_env, hostfile = jaccl.rank_env(hosts, 0)
            os.environ.update(group_env)
        else:
            fd, hostfile = tempfile.mkstemp(prefix="kimi-mlx-hosts-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(hosts)
            os.environ.update(MLX_RANK="0", MLX_HOSTFILE=hostfile)
        try:
            group = mx.distributed.init(backend=backend, strict=True)
        finally:
            os.unlink(hostfile)
        model, _ = load_sharded(cluster.model_dir, group)
    except BaseException:
        watch.close()
        transport.shutdown()
        raise
    return transport, group, model


def launch_tensor(args, cluster, ids: List[int], wrapper, speculation=None) -> int:
    """`cluster launch --parallel tensor`: form the group (`form_group`), generate `ids`'
    continuation on rank 0 (plain, or speculatively with `speculation`'s draft on this
    head: `cluster.tensor_step`) and print it as `kimi-mlx generate` does.

    Returns the exit status; a rank lost mid-generation ends the process through
    `TensorGroup.fail`.
    """
    from kimi_mlx.cluster.tensor.step import (OP_EXIT, command, group_stream, plain_run,
                                              speculative_run)
    from kimi_mlx.generation.generate import print_generation
    from kimi_mlx.generation.streaming import stream_responses
    from mlx_lm.sample_utils import make_sampler

    watch = TensorGroup(args.peer_timeout)
    try:
        transport, group, model = form_group(args, cluster, watch)
    except (TensorSetupError, RuntimeError, ValueError, OSError) as e:
        print(f"kimi-mlx cluster launch: error: {e}", file=sys.stderr)
        return 1
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)

    def tokens():
        if speculation is not None:
            yield from group_stream(model, group, ids, speculative_run(
                ids, speculation.draft, max_tokens=args.max_tokens, **speculation.kwargs()),
                record=True)
            return
        for tok, lp in group_stream(model, group, ids,
                                    plain_run(ids, args.max_tokens, sampler)):
            yield tok, lp, False

    try:
        code = print_generation(args, stream_responses(tokens(), wrapper, len(ids), args.max_tokens,
                                                       mx.get_peak_memory))
        command(group, OP_EXIT)  # the other ranks exit
        watch.finish()
        if speculation is not None and args.verbose:
            print(speculation.summary())
    except RuntimeError as e:  # a peer lost: its node names it through the watch
        deadline = time.monotonic() + args.peer_timeout + 2
        while watch.failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.fail(f"rank 0 (this head): {e}")
        return 1
    finally:
        watch.close()
        transport.shutdown()
    return code


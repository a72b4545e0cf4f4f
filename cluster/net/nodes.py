"""Which nodes a head may use: addresses from `--nodes`, and each candidate confirmed with
an authenticated `Health` call (protocol, package version, checkpoint, unique id), the
rest named with the reason (`Rejected`). Both strategies start here."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import grpc

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.control import rpc_reason
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, build_id, package_versions

log = logging.getLogger("kimi_mlx.cluster.head")


@dataclass
class Rejected:
    """A node not used, and why.

    kind: "unreachable" (no answer: down, hung, off the network; starting it helps),
    "secret" (another cluster secret or clock), "protocol" (another stage protocol or
    not a stage), "version", "checkpoint", "duplicate" (node id), "error" (other).
    """

    node_id: str
    address: str
    reason: str
    kind: str = "error"

    @property
    def unreachable(self) -> bool:
        """Whether the node did not answer at all (so `start it` is the fix)."""
        return self.kind == "unreachable"


def health_info(reply: pb.HealthReply, host: str, port: int) -> NodeInfo:
    """NodeInfo from a Health reply (what the node says over an authenticated call)."""
    return NodeInfo(node_id=reply.node_id, host=host, port=port, protocol=reply.protocol,
                    version=reply.version, mlx_version=reply.mlx_version,
                    total_memory=reply.total_memory, usable_memory=reply.usable_memory,
                    chip=reply.chip, bandwidth=reply.bandwidth,
                    fingerprints=list(reply.fingerprints), key_id=reply.key_id)


def parse_address(spec: str, default_port: int) -> Tuple[str, int]:
    """'host', 'host:port' or '[v6]:port' -> (host, port). ValueError when malformed."""
    spec = spec.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif spec.count(":") == 1:
        host, port = spec.split(":")
    else:
        host, port = spec, ""
    if not host:
        raise ValueError(f"--nodes: {spec!r} has no host")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise ValueError(f"--nodes: {spec!r}: port {port!r} is not a number") from None


_KINDS = {grpc.StatusCode.UNAVAILABLE: "unreachable", grpc.StatusCode.DEADLINE_EXCEEDED: "unreachable",
          grpc.StatusCode.UNAUTHENTICATED: "secret", grpc.StatusCode.UNIMPLEMENTED: "protocol"}


def check_nodes(candidates: List[NodeInfo], stub_for: Callable[[str], object], fp: Optional[str],
                timeout: float = 2.0, check_version: bool = True,
                channel_for: Optional[Callable[[str], grpc.Channel]] = None,
                name: str = "",
                ) -> Tuple[List[Tuple[NodeInfo, pb.HealthReply]], List[Rejected]]:
    """Confirm each candidate with an authenticated Health call (in parallel) and keep
    those with our protocol, package version and the checkpoint's fingerprint (not
    checked when `fp` is None; `name`, the checkpoint's folder name, for messages).

    Returns (accepted [(NodeInfo from Health, reply)], rejected with reasons and kinds).
    A candidate that does not answer (a stale advertisement, a node that is down) is
    rejected as "not answering" (kind "unreachable"); one that refuses our secret as
    "secret"; one without our stage service as "protocol", naming the protocol it
    speaks (asked with `channel_for(address)`'s gRPC reflection, or as advertised).
    """
    ours, our_mlx = package_versions()
    results: List[Optional[Tuple]] = [None] * len(candidates)

    def one(k: int):
        n = candidates[k]
        try:
            results[k] = ("ok", stub_for(n.address).Health(pb.HealthRequest(), timeout=timeout))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            channel = channel_for(n.address) if channel_for and code == grpc.StatusCode.UNIMPLEMENTED else None
            results[k] = ("err", rpc_reason(e, "Health", channel, timeout, n.protocol),
                          _KINDS.get(code, "error"))

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(candidates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 2)
    accepted, rejected, seen = [], [], set()
    for n, res in zip(candidates, results):
        if res is None:
            rejected.append(Rejected(n.node_id, n.address, "not answering: no answer", "unreachable"))
            continue
        if res[0] == "err":
            why, kind = res[1], res[2]
            rejected.append(Rejected(n.node_id, n.address,
                                     f"not answering: {why}" if kind == "unreachable" else why, kind))
            continue
        reply = res[1]
        info = health_info(reply, n.host, n.port)
        reason, kind = None, "error"
        if reply.protocol != PROTOCOL_VERSION:
            reason, kind = (f"speaks stage protocol {reply.protocol}, this head {PROTOCOL_VERSION}: "
                            f"install the same kimi-mlx on both (node {reply.version}, head {ours})",
                            "protocol")
        elif check_version and reply.version != ours:
            reason, kind = (f"runs kimi-mlx {reply.version}, this head {ours}: install the same "
                            "version everywhere (or pass --allow-version-mismatch)", "version")
        elif fp is not None and fp not in reply.fingerprints:
            ours_named = f"{name} (fingerprint {fp})" if name else f"(fingerprint {fp})"
            reason, kind = (f"does not have the checkpoint {ours_named} in its models folder; "
                            f"it has: {held_checkpoints(reply)}; copy it there (no restart "
                            "needed: the node rescans its folder)", "checkpoint")
        elif info.node_id in seen:
            reason, kind = (f"a second node calls itself {info.node_id}: give each a unique "
                            "--node-id", "duplicate")
        if reason:
            rejected.append(Rejected(info.node_id or n.node_id, n.address, reason, kind))
            continue
        if reply.mlx_version != our_mlx:
            log.warning("node %s runs MLX %s, this head %s", info.node_id, reply.mlx_version, our_mlx)
        if reply.build and reply.build != build_id():
            log.warning("node %s runs other kimi-mlx sources than this head (build %s, head %s): "
                        "outputs may differ slightly from one process here", info.node_id,
                        reply.build, build_id())
        seen.add(info.node_id)
        accepted.append((info, reply))
    return accepted, rejected


def held_checkpoints(reply: pb.HealthReply) -> str:
    """The checkpoints a node's Health reply lists, as 'folder (fingerprint), ...' ('none'
    when empty; bare fingerprints from a node that does not send names)."""
    names = list(reply.checkpoint_names)
    if len(names) != len(reply.fingerprints):
        names = [""] * len(reply.fingerprints)
    return ", ".join(f"{n} ({fp})" if n else fp
                     for n, fp in zip(names, reply.fingerprints)) or "none"

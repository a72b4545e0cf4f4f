"""Which nodes a head may use: addresses from `--nodes`, and each candidate confirmed with
an authenticated `Health` call (protocol, package version, checkpoint, unique id), the
rest named with the reason (`Rejected`). Both strategies start here."""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import grpc

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.control import rpc_reason
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, build_id, package_versions
from kimi_mlx.model.cache import KV_DEFAULT_GROUP

log = logging.getLogger(__name__)


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


def check_browse_time(flag: str, seconds: float) -> None:
    """ValueError (a one-line reason naming `flag`) for a browse too short to hear any node."""
    from kimi_mlx.cluster.net.discovery import MIN_BROWSE_S

    if not seconds >= MIN_BROWSE_S:
        raise ValueError(f"{flag} {seconds:g} is too short to hear any node: mDNS queries go "
                         "out after a random 20-120 ms and answers take up to 120 ms more "
                         f"(RFC 6762); give at least {MIN_BROWSE_S:g} s")


@dataclass(frozen=True)
class NodeSettings:
    """How a head finds and trusts its nodes (`cluster launch` / `cluster server` flags).

    nodes: "auto" (zeroconf) or "host[:port],..." in pipeline order. discover_timeout:
    seconds to browse (auto). interface: where to browse (name or IPv4; None: all).
    check_version: refuse nodes with another kimi-mlx version. replan: carry on over the
    nodes left when a named node is unusable or a stage is lost. secret_file / tls: the
    cluster secret and whether to use its TLS certificate. peer_timeout: seconds of
    silence before a stage or rank is reported lost. kv_bits / kv_group_size: the DSA
    caches' format every stage and rank keeps (`--kv-bits`; None: the model dtype).
    """

    secret_file: Path
    nodes: str = "auto"
    discover_timeout: float = 3.0
    interface: Optional[str] = None
    check_version: bool = True
    replan: bool = False
    tls: bool = False
    peer_timeout: float = 5.0
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_DEFAULT_GROUP

    @property
    def tls_secret_path(self) -> Optional[Path]:
        """The secret path whose certificate enables TLS, or None without --tls."""
        return self.secret_file if self.tls else None


class NodeFinder:
    """Discovery -> checks, repeatable (a replan excludes lost nodes): the nodes a head may
    use for checkpoint `fp` (folder `model_dir`), found with `settings`. Both strategies
    start here: the pipeline's `head.cluster.Cluster` plans and loads over them, a tensor
    group (`tensor.launch.form_group`) starts a rank on each.

    `excluded`: node ids left out from now on. `checked`: an `accepted()` answer kept for
    its next call (the parallel choice asks first, then the launch uses the same nodes).
    """

    def __init__(self, settings: NodeSettings, secret: bytes, model_dir: Path, fp: str):
        self.settings, self.secret, self.model_dir, self.fp = settings, secret, model_dir, fp
        self.excluded: set = set()
        self.checked = None

    def candidates(self) -> List[NodeInfo]:
        """The nodes to check: zeroconf's (RuntimeError when none answers) or --nodes'."""
        from kimi_mlx.cluster.net.discovery import DEFAULT_PORT, browse, interface_addresses

        a = self.settings
        if a.nodes == "auto":
            nodes = browse(a.discover_timeout, interface_addresses(a.interface))
            if not nodes:
                raise RuntimeError(f"no kimi-mlx nodes found in {a.discover_timeout:g} s "
                                   "(is `kimi-mlx cluster serve` running on each Mac, on this network?)")
            return nodes
        out = []
        for spec in a.nodes.split(","):
            if spec.strip():
                host, port = parse_address(spec, DEFAULT_PORT)
                out.append(NodeInfo(node_id=spec.strip(), host=host, port=port))
        return out

    def accepted(self, transport) -> List[Tuple[NodeInfo, pb.HealthReply]]:
        """[(NodeInfo, HealthReply)] of the usable nodes, asked through `transport`'s
        `stub_for` / `channel_for` (a `net.control.ControlClient`); RuntimeError when
        --nodes names one that is not usable, or none is."""
        if self.checked is not None:
            accepted, self.checked = self.checked, None
            return accepted
        a = self.settings
        accepted, rejected = check_nodes(self.candidates(), transport.stub_for, self.fp,
                                         name=self.model_dir.name,
                                         check_version=a.check_version,
                                         channel_for=transport.channel_for)
        named = a.nodes != "auto"
        if named and rejected and not a.replan and not self.excluded:
            # --nodes fixes the stages' order: run on exactly those, or say which one is not usable
            down = sum(r.unreachable for r in rejected)  # "start it" helps only these
            fix = ("start it" if down == len(rejected) else "fix it as said" if not down
                   else "start or fix them as said")
            raise RuntimeError("; ".join(f"node {r.address} (named in --nodes) is not usable: "
                                         f"{r.reason}" for r in rejected)
                               + f"; {fix}, leave it out of --nodes, or pass --replan to "
                                 "continue on the others")
        for r in rejected:
            where = r.address if r.node_id == r.address else f"{r.node_id} at {r.address}"
            print(f"[cluster] skipping node {where}: {r.reason}", file=sys.stderr)
        accepted = [(n, r) for n, r in accepted if n.node_id not in self.excluded]
        if not accepted:
            raise RuntimeError("no usable nodes")
        if a.nodes == "auto":
            accepted.sort(key=lambda x: x[0].node_id)
        return accepted

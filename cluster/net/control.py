"""The control-plane client: authenticated one-off calls from a head to nodes, and what a
failed call means in words.

Both strategies use it: the pipeline's head checks and loads stages through it
(`head.transport.GrpcTransport` builds on `ControlClient`), and a tensor group's head
checks its nodes and starts their ranks (`StartRank`) through it.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import List, Optional

import grpc

from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.net.channel import DEFAULT_MAX_MESSAGE, STAGE_SERVICE, make_channel
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION


class ControlClient:
    """Authenticated channels and stubs to nodes under one head id (`head_id`, the lease
    and plan id the nodes see).

    Args:
        secret: cluster secret. tls_secret_path: enable TLS with the cluster certificate.
        max_message: gRPC message bound (bytes) of every channel.
    """

    def __init__(self, secret: bytes, tls_secret_path: Optional[Path] = None,
                 max_message: int = DEFAULT_MAX_MESSAGE):
        self.secret = secret
        self.tls = tls_secret_path
        self.max_message = max_message
        self.head_id = f"head-{uuid.uuid4().hex[:12]}"

    def channel_for(self, address: str) -> grpc.Channel:
        """A new authenticated channel (for one-off calls such as Health)."""
        return make_channel(address, self.secret, self.tls, self.max_message)

    def stub_for(self, address: str) -> pb_grpc.StageStub:
        """A stub on a new authenticated channel (for one-off calls such as Health)."""
        return pb_grpc.StageStub(self.channel_for(address))

    def shutdown(self) -> None:
        """Release what this client holds: nothing here (a one-off channel belongs to its
        caller); `GrpcTransport` closes its stages' channels and leases."""


STAGE_SERVICE_RE = re.compile(r"^kimimlx\.stage\.v(\d+)\.Stage$")


def list_services(channel: grpc.Channel, timeout: float = 2.0) -> Optional[List[str]]:
    """Full names of the gRPC services a node serves (gRPC server reflection, which
    every stage serves); None when it answers without a list.

    Raises:
        grpc.RpcError: the node refused or did not answer (UNIMPLEMENTED: no reflection).
    """
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for reply in stub.ServerReflectionInfo(iter([request]), timeout=timeout):
        if reply.HasField("list_services_response"):
            return [s.name for s in reply.list_services_response.service]
        return None
    return None


def protocol_mismatch(method: str, services: Optional[List[str]], advertised: int = 0) -> str:
    """Why a node answered UNIMPLEMENTED to `method` ('Health', 'Load', ...): the stage
    protocol(s) it serves (from `list_services`) against this head's, or what it is
    instead. `advertised`: the protocol its zeroconf record claims (0 unknown)."""
    ours = f"stage protocol {PROTOCOL_VERSION} ({STAGE_SERVICE})"
    theirs = [m for m in (STAGE_SERVICE_RE.match(s) for s in services or []) if m]
    if theirs:
        names = ", ".join(f"{int(m.group(1))} ({m.group(0)})" for m in theirs)
        return (f"speaks stage protocol {names}, this head {ours}: install the same kimi-mlx "
                "version on both")
    said = f"; its zeroconf record says stage protocol {advertised}" if advertised else ""
    if services is not None:
        return (f"serves no kimi-mlx stage protocol (it serves: {', '.join(services) or 'nothing'}"
                f"{said}), this head {ours}: another program on that port, or another "
                "kimi-mlx version")
    return (f"does not serve {STAGE_SERVICE}/{method} (this head speaks {ours}) and does not "
            f"list its services{said}: another program on that port, or another kimi-mlx "
            "version; install the same version on both")


def rpc_reason(e: grpc.RpcError, method: str = "", channel: Optional[grpc.Channel] = None,
                timeout: float = 2.0, advertised: int = 0) -> str:
    """A failed call in words. UNIMPLEMENTED with a `channel`: asks the node which
    services it serves and names both protocol versions (`protocol_mismatch`)."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"connection lost or refused (process died or network down): {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer before the deadline (hung or unreachable): {details}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if "wrong cluster secret" in (details or ""):
            return (f"uses another cluster secret (it refused ours: {details}): copy the "
                    "secret file from the Mac that ran `kimi-mlx cluster init` to it")
        return f"refused our credentials ({details}): is the cluster secret the same?"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in (details or ""):
        return (f"busy: it serves as many calls at once as it has threads for ({details}); "
                "too many heads at once, try again (or raise its --max-sessions)")
    if code == grpc.StatusCode.UNIMPLEMENTED and channel is not None:
        try:
            services = list_services(channel, timeout)
        except grpc.RpcError as e2:
            services = None
            if e2.code() == grpc.StatusCode.UNAUTHENTICATED:  # asking needs the secret
                return (f"{protocol_mismatch(method or '?', None, advertised)}; asked which "
                        f"services it serves, it refused our credentials ({e2.details()}): it "
                        "uses another cluster secret, too")
        return protocol_mismatch(method or "?", services, advertised)
    return f"{code.name if code else 'error'}: {details}"

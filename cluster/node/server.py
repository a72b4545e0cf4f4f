"""`kimi-mlx cluster serve`'s gRPC server around a `node.service.StageService`:
authentication, TLS, reflection, keepalive, and the zeroconf advertisement."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path
from typing import Optional

import grpc

from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.net.auth import ServerAuth, key_id, server_credentials
from kimi_mlx.cluster.net.channel import KEEPALIVE_OPTIONS, STAGE_SERVICE
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, package_versions
from kimi_mlx.cluster.node.service import StageService

log = logging.getLogger(__name__)


class StageServer:
    """A running stage service: gRPC server (+ optional zeroconf advertisement).

    Args:
        service: the StageService.
        addresses: IPv4 addresses to listen on ("0.0.0.0" for all).
        port: TCP port (0 = any free one; then only one address is allowed).
        secret: cluster secret (server interceptor). tls: use the cluster certificate.
    """

    def __init__(self, service: StageService, addresses, port: int, secret: bytes,
                 tls_secret_path: Optional[Path] = None, workers: Optional[int] = None):
        self.service = service
        workers = workers or 3 * service.max_sessions + 8
        options = [("grpc.max_receive_message_length", service.max_message),
                   ("grpc.max_send_message_length", service.max_message),
                   ("grpc.so_reuseport", 0),
                   ("grpc.http2.min_ping_interval_without_data_ms", 1000)] + KEEPALIVE_OPTIONS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                             thread_name_prefix="rpc"),
                                  interceptors=[ServerAuth(secret)], options=options,
                                  maximum_concurrent_rpcs=workers)
        pb_grpc.add_StageServicer_to_server(service, self.server)
        # gRPC server reflection lists the services served, so a head speaking another
        # stage protocol (another service name) can name both versions.
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection((STAGE_SERVICE, reflection.SERVICE_NAME), self.server)
        creds = server_credentials(tls_secret_path) if tls_secret_path else None
        addresses = list(addresses)
        if port == 0 and len(addresses) > 1:
            raise ValueError("port 0 (any free port) needs a single listen address")
        self.port = port
        for a in addresses:
            target = f"{a}:{self.port}"
            bound = (self.server.add_secure_port(target, creds) if creds
                     else self.server.add_insecure_port(target))
            if not bound:
                raise OSError(f"cannot listen on {target}")
            self.port = bound
        self.addresses = addresses
        self.advertiser = None

    def start(self) -> "StageServer":
        """Start serving (returns self)."""
        self.server.start()
        return self

    def advertise(self, addresses, tls: bool = False, ttl: int = 120) -> None:
        """Register the zeroconf record on `addresses` (IPv4)."""
        from kimi_mlx.cluster.net.discovery import Advertiser, NodeInfo

        s = self.service
        ours, mlx_version = package_versions()
        info = NodeInfo(node_id=s.node_id, host=addresses[0], port=self.port,
                        protocol=PROTOCOL_VERSION, version=ours, mlx_version=mlx_version,
                        total_memory=s.total_memory, usable_memory=s.usable_memory,
                        chip=s.chip, bandwidth=s.bandwidth, fingerprints=sorted(s.catalog),
                        key_id=key_id(s.secret), tls=tls, wired_mb=s.wired_mb)
        self.advertiser = Advertiser(info, list(addresses), ttl=ttl)

    def stop(self, grace: float = 1.0) -> None:
        """Unadvertise (mDNS goodbye), free sessions, stop serving."""
        if self.advertiser is not None:
            try:
                self.advertiser.close()
            except Exception as e:  # best effort on shutdown
                log.warning("unadvertise failed: %s", e)
            self.advertiser = None
        self.service.close()
        self.server.stop(grace).wait(grace + 1)

"""gRPC channels to a stage: message bounds, keepalive, authentication, TLS.

The head's transport, a stage's downstream link and every control-plane call open their
channels here, so both ends agree on the message limit and the keepalive pings (a stage
answers pings only as often as `KEEPALIVE_OPTIONS` sends them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import grpc

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.auth import ClientAuth, channel_credentials, TLS_NAME

DEFAULT_MAX_MESSAGE = 256 << 20
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
STAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name  # "kimimlx.stage.v1.Stage"


def channel_options(max_message: int = DEFAULT_MAX_MESSAGE):
    """gRPC channel options shared by the head and stages: message bounds, keepalive."""
    return [("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.enable_retries", 0)] + KEEPALIVE_OPTIONS


def make_channel(address: str, secret: bytes, tls_secret_path: Optional[Path] = None,
                 max_message: int = DEFAULT_MAX_MESSAGE) -> grpc.Channel:
    """An authenticated channel to a stage (TLS when `tls_secret_path` is given)."""
    options = channel_options(max_message)
    if tls_secret_path is not None:
        options.append(("grpc.ssl_target_name_override", TLS_NAME))
        ch = grpc.secure_channel(address, channel_credentials(tls_secret_path), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, ClientAuth(secret))

"""Nodes the head cannot use, told apart: one that speaks another stage protocol (a
renamed gRPC service, as a new stage.proto version will be) is named with both protocol
versions; one with another cluster secret is told so; only a node that does not answer
is told to be started. In-process gRPC servers stand in for those nodes."""

import os
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_reflection.v1alpha import reflection

from kimi_mlx.cluster.net.auth import ServerAuth
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.cluster.net.nodes import check_nodes
from kimi_mlx.cluster.net.channel import STAGE_SERVICE
from kimi_mlx.cluster.head.transport import GrpcTransport
from kimi_mlx.cluster.net.control import list_services
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION

SECRET = b"a" * 64
OTHER_SECRET = b"b" * 64
OURS = STAGE_SERVICE  # "kimimlx.stage.v<PROTOCOL_VERSION>.Stage"
NEXT_VERSION = PROTOCOL_VERSION + 1
NEXT = f"kimimlx.stage.v{NEXT_VERSION}.Stage"  # a later stage protocol


def _fake_node(secret, service=None, reflect=True):
    """A gRPC server with the cluster's auth that serves `service`/Health (answering
    empty bytes) and, with `reflect`, lists its services. Returns (server, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[ServerAuth(secret)])
    names = []
    if service:
        health = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Health": health}),))
        names.append(service)
    if reflect:
        reflection.enable_server_reflection(names + [reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture(scope="module")
def nodes():
    made = {"next": _fake_node(SECRET, NEXT), "next-silent": _fake_node(SECRET, NEXT, reflect=False),
            "other-secret": _fake_node(OTHER_SECRET, OURS),
            "next-other-secret": _fake_node(OTHER_SECRET, NEXT), "foreign": _fake_node(SECRET, "acme.Thing")}
    try:
        yield {name: port for name, (_, port) in made.items()}
    finally:
        for server, _ in made.values():
            server.stop(0)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_unusable_node_is_told_apart(nodes):
    t = GrpcTransport(SECRET)
    down = _free_port()
    candidates = [NodeInfo("next", "127.0.0.1", nodes["next"]),
                  NodeInfo("next-silent", "127.0.0.1", nodes["next-silent"], protocol=NEXT_VERSION),
                  NodeInfo("other-secret", "127.0.0.1", nodes["other-secret"]),
                  NodeInfo("next-other-secret", "127.0.0.1", nodes["next-other-secret"]),
                  NodeInfo("foreign", "127.0.0.1", nodes["foreign"]),
                  NodeInfo("down", "127.0.0.1", down)]
    accepted, rejected = check_nodes(candidates, t.stub_for, None, timeout=5.0,
                                     channel_for=t.channel_for)
    assert accepted == []
    why = {r.node_id: r for r in rejected}
    assert set(why) == {"next", "next-silent", "other-secret", "next-other-secret", "foreign", "down"}
    assert why["next"].kind == "protocol"
    assert (f"speaks stage protocol {NEXT_VERSION} ({NEXT}), this head stage protocol "
            f"{PROTOCOL_VERSION} ({OURS})") in why["next"].reason
    r = why["next-silent"]  # no reflection: what it advertised, and what this head speaks
    assert r.kind == "protocol" and f"does not serve {OURS}/Health" in r.reason
    assert f"stage protocol {PROTOCOL_VERSION}" in r.reason
    assert f"its zeroconf record says stage protocol {NEXT_VERSION}" in r.reason
    assert why["foreign"].kind == "protocol" and "acme.Thing" in why["foreign"].reason
    r = why["other-secret"]
    assert r.kind == "secret" and "uses another cluster secret" in r.reason
    assert "not answering" not in r.reason
    r = why["next-other-secret"]  # refuses even the question which services it serves
    assert r.kind == "protocol" and f"does not serve {OURS}/Health" in r.reason
    assert "uses another cluster secret" in r.reason
    assert why["down"].kind == "unreachable" and why["down"].reason.startswith("not answering")
    assert [r.unreachable for r in rejected].count(True) == 1


def test_launch_names_the_fix_not_start_it(nodes, tmp_path):
    from kimi_mlx.cluster.net.auth import init_secret

    secret_file = init_secret(tmp_path / "cluster.key")
    with open(secret_file, "w") as f:  # the secret the fake next-version node accepts
        f.write(SECRET.decode() + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "launch", "--nodes",
         f"127.0.0.1:{nodes['next']},127.0.0.1:{nodes['other-secret']}", "--secret-file",
         str(secret_file), "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == 1, run.stderr
    assert (f"speaks stage protocol {NEXT_VERSION} ({NEXT}), this head stage protocol "
            f"{PROTOCOL_VERSION}") in run.stderr
    assert "uses another cluster secret" in run.stderr
    assert "start it" not in run.stderr and "fix it as said" in run.stderr


def test_a_stage_lists_its_service_for_heads_of_other_versions():
    from kimi_mlx.cluster.node.server import StageServer
    from kimi_mlx.cluster.node.service import StageService

    service = StageService("reflect", None, SECRET)
    server = StageServer(service, ["127.0.0.1"], 0, SECRET).start()
    try:
        services = list_services(GrpcTransport(SECRET).channel_for(f"127.0.0.1:{server.port}"))
        assert STAGE_SERVICE == f"kimimlx.stage.v{PROTOCOL_VERSION}.Stage" and STAGE_SERVICE in services
    finally:
        server.stop(0)


def test_a_node_out_of_call_threads_is_named_busy_not_down():
    import threading

    from kimi_mlx.cluster.net.control import rpc_reason

    release = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[ServerAuth(SECRET)],
                         maximum_concurrent_rpcs=1)

    def hold(request, context):
        release.wait(10)
        return b""

    handler = grpc.unary_unary_rpc_method_handler(hold)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(OURS, {"Health": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = GrpcTransport(SECRET).stub_for(f"127.0.0.1:{port}")
        from kimi_mlx.cluster.net import stage_pb2 as pb

        first = stub.Health.future(pb.HealthRequest(), timeout=10)
        time.sleep(0.3)  # the first call holds the only slot
        with pytest.raises(grpc.RpcError) as e:
            stub.Health(pb.HealthRequest(), timeout=5)
        reason = rpc_reason(e.value)
        assert reason.startswith("busy:") and "too many heads at once" in reason
        release.set()
        first.result(10)  # the held call ends normally
    finally:
        release.set()
        server.stop(0)

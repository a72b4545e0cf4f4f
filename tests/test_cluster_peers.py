"""Nodes the head cannot use, told apart: one that speaks another stage protocol (a
renamed gRPC service, as a new stage.proto version will be) is named with both protocol
versions; one with another cluster secret is told so; only a node that does not answer
is told to be started. In-process gRPC servers stand in for those nodes."""

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_reflection.v1alpha import reflection

from kimi_mlx.cluster.auth import ServerAuth
from kimi_mlx.cluster.discovery import NodeInfo
from kimi_mlx.cluster.head import check_nodes
from kimi_mlx.cluster.transport import GrpcTransport, list_services

SECRET = b"a" * 64
OTHER_SECRET = b"b" * 64
V2 = "kimimlx.stage.v2.Stage"


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
    made = {"v2": _fake_node(SECRET, V2), "v2-silent": _fake_node(SECRET, V2, reflect=False),
            "other-secret": _fake_node(OTHER_SECRET, "kimimlx.stage.v1.Stage"),
            "v2-other-secret": _fake_node(OTHER_SECRET, V2), "foreign": _fake_node(SECRET, "acme.Thing")}
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
    candidates = [NodeInfo("v2", "127.0.0.1", nodes["v2"]),
                  NodeInfo("v2-silent", "127.0.0.1", nodes["v2-silent"], protocol=2),
                  NodeInfo("other-secret", "127.0.0.1", nodes["other-secret"]),
                  NodeInfo("v2-other-secret", "127.0.0.1", nodes["v2-other-secret"]),
                  NodeInfo("foreign", "127.0.0.1", nodes["foreign"]),
                  NodeInfo("down", "127.0.0.1", down)]
    accepted, rejected = check_nodes(candidates, t.stub_for, None, timeout=5.0,
                                     channel_for=t.channel_for)
    assert accepted == []
    why = {r.node_id: r for r in rejected}
    assert set(why) == {"v2", "v2-silent", "other-secret", "v2-other-secret", "foreign", "down"}
    assert why["v2"].kind == "protocol"
    assert ("speaks stage protocol 2 (kimimlx.stage.v2.Stage), this head stage protocol 1 "
            "(kimimlx.stage.v1.Stage)") in why["v2"].reason
    r = why["v2-silent"]  # no reflection: what it advertised, and what this head speaks
    assert r.kind == "protocol" and "does not serve kimimlx.stage.v1.Stage/Health" in r.reason
    assert "stage protocol 1" in r.reason and "its zeroconf record says stage protocol 2" in r.reason
    assert why["foreign"].kind == "protocol" and "acme.Thing" in why["foreign"].reason
    r = why["other-secret"]
    assert r.kind == "secret" and "uses another cluster secret" in r.reason
    assert "not answering" not in r.reason
    r = why["v2-other-secret"]  # refuses even the question which services it serves
    assert r.kind == "protocol" and "does not serve kimimlx.stage.v1.Stage/Health" in r.reason
    assert "uses another cluster secret" in r.reason
    assert why["down"].kind == "unreachable" and why["down"].reason.startswith("not answering")
    assert [r.unreachable for r in rejected].count(True) == 1


def test_launch_names_the_fix_not_start_it(nodes, tmp_path):
    from kimi_mlx.cluster.auth import init_secret

    secret_file = init_secret(tmp_path / "cluster.key")
    with open(secret_file, "w") as f:  # the secret the fake v2 node accepts
        f.write(SECRET.decode() + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "kimi_mlx.cli", "cluster", "launch", "--nodes",
         f"127.0.0.1:{nodes['v2']},127.0.0.1:{nodes['other-secret']}", "--secret-file",
         str(secret_file), "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == 1, run.stderr
    assert "speaks stage protocol 2 (kimimlx.stage.v2.Stage), this head stage protocol 1" in run.stderr
    assert "uses another cluster secret" in run.stderr
    assert "start it" not in run.stderr and "fix it as said" in run.stderr


def test_a_stage_lists_its_service_for_heads_of_other_versions():
    from kimi_mlx.cluster.service import STAGE_SERVICE, StageServer, StageService

    service = StageService("reflect", None, SECRET)
    server = StageServer(service, ["127.0.0.1"], 0, SECRET).start()
    try:
        services = list_services(GrpcTransport(SECRET).channel_for(f"127.0.0.1:{server.port}"))
        assert STAGE_SERVICE == "kimimlx.stage.v1.Stage" and STAGE_SERVICE in services
    finally:
        server.stop(0)

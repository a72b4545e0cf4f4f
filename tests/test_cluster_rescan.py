"""`cluster serve` offers a checkpoint copied into its models folder after it started, and
names checkpoints by folder with the fingerprint beside it (issue 19, item 5)."""

import shutil
import subprocess
import sys

import pytest

from kimi_mlx.cluster.net.auth import init_secret, load_secret
from kimi_mlx.cluster.net.discovery import NodeInfo
from kimi_mlx.cluster.net.fingerprint import fingerprint
from kimi_mlx.cluster.net.nodes import check_nodes
from kimi_mlx.cluster.head.transport import GrpcTransport
from kimi_mlx.generation.request import default_model
from kimi_mlx.testing.checkpoints import build_checkpoint
from kimi_mlx.testing.cluster import start_stages, stop_all


@pytest.fixture
def node(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    secret_file = init_secret(tmp_path / "cluster.key")
    procs = start_stages(1, models, secret_file, tmp_path, prefix="rescan")
    try:
        yield procs[0], models, secret_file
    finally:
        stop_all(procs)


@pytest.mark.e2e  # a node of its own, a checkpoint built and copied in, a launch (make test-e2e)
def test_a_checkpoint_copied_into_a_running_node_is_launchable(node, tmp_path):
    proc, models, secret_file = node
    src = build_checkpoint(tmp_path / "src" / "my-build", seed=3)
    fp = fingerprint(src)
    t = GrpcTransport(load_secret(secret_file))
    candidates = [NodeInfo("rescan0", proc.host, proc.port)]

    accepted, rejected = check_nodes(candidates, t.stub_for, fp, name=src.name, timeout=10.0)
    shipped = default_model()
    has = f"{shipped.name} ({fingerprint(shipped)})" if shipped is not None else "none"
    assert accepted == [] and [r.reason for r in rejected] == [
        f"does not have the checkpoint my-build (fingerprint {fp}) in its models folder; "
        f"it has: {has}; copy it there (no restart needed: the node rescans its folder)"]

    shutil.copytree(src, models / "my-build")
    accepted, rejected = check_nodes(candidates, t.stub_for, fp, name=src.name, timeout=10.0)
    assert rejected == [] and len(accepted) == 1
    reply = accepted[0][1]
    assert dict(zip(reply.fingerprints, reply.checkpoint_names))[fp] == "my-build"

    res = subprocess.run(
        [sys.executable, "-m", "kimi_mlx", "cluster", "launch", "--model", str(src),
         "--nodes", proc.address, "--secret-file", str(secret_file), "--prompt", "def f(x):",
         "--ignore-chat-template", "--max-tokens", "2", "--quiet"],
        capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "Generation: 2 tokens" in res.stdout

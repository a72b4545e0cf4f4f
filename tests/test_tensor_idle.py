"""Idle tensor ranks sleep, and stop cleanly.

A 2-rank group on loopback from the product's own processes (`kimi_mlx.testing.idle`:
the server's rank 0 child and a node's rank process, MLX's ring backend): once it parks
(`cluster.tensor.wire.park`, done by rank 0's child after `relay.PARK_AFTER` s without a
command) neither process uses CPU while it waits; the same group with parking off
(KIMI_MLX_TENSOR_PARK_AFTER=inf, the ranks wait in `all_sum` as before) spins, which is
what the first test would see without the doorbell. After the idle time the group still
computes what one process computes (the checkpoint loaded here, the independent
reference). Stops: SIGTERM to a parked rank and to rank 0's child ends each with exit 0
within the bound, no SIGKILL.

Linux only (CPU time from /proc). Hard timeouts on every wait.
"""

import os
import signal
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="CPU time from /proc")

IDLE_WINDOW = 5.0  # seconds of CPU time measured
IDLE_BOUND = 0.1  # CPU seconds per process per window (a spinning rank uses ~1-5 s)
IDS = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from kimi_mlx.testing.cluster import reference_checkpoint

    return reference_checkpoint(tmp_path_factory.mktemp("idle"))


def one_process_logits(ckpt):
    import mlx.core as mx

    from kimi_mlx.checkpoint.loader import load_model

    model, _, _ = load_model(ckpt)
    out = model(mx.array(IDS)[None])
    return np.array(out.astype(mx.float32))


def test_parked_group_uses_no_cpu_and_still_computes(ckpt):
    from kimi_mlx.cluster.tensor.relay import PARK_AFTER
    from kimi_mlx.testing.idle import IdleGroup

    with IdleGroup(ckpt) as g:
        g.command()
        time.sleep(PARK_AFTER + 1.0)  # parked by now
        cpu = g.cpu(IDLE_WINDOW)
        print(f"idle CPU seconds over {IDLE_WINDOW:.0f} s: {cpu}")
        assert all(v < IDLE_BOUND for v in cpu.values()), cpu
        got = g.forward(IDS)  # the first command after the idle time wakes the group
        import mlx.core as mx

        got = np.array(got.astype(mx.float32))
        codes = g.stop()
    assert codes == {"rank 0": 0, "rank 1": 0}, codes
    ref = one_process_logits(ckpt)
    assert got.shape == ref.shape
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_without_parking_an_idle_rank_spins(ckpt, monkeypatch):
    """The measurement can fail: the same group whose rank 0 never parks (today's idle
    before the doorbell) keeps rank 1 busy in `all_sum`."""
    from kimi_mlx.testing.idle import IdleGroup

    monkeypatch.setenv("KIMI_MLX_TENSOR_PARK_AFTER", "inf")  # read by rank 0's child
    with IdleGroup(ckpt) as g:
        g.command()
        time.sleep(1.0)
        cpu = g.cpu(IDLE_WINDOW)
        print(f"idle CPU seconds over {IDLE_WINDOW:.0f} s without parking: {cpu}")
        assert cpu["rank 1"] > IDLE_BOUND, cpu  # the bound the parked group keeps


def test_sigterm_stops_parked_ranks_cleanly(ckpt):
    """The node's stop of its rank (`RankProcess.kill`) and the server's stop of rank 0's
    child (`Rank0Process.kill`) send SIGTERM: both exit 0 well within the bound."""
    from kimi_mlx.cluster.net.lifetime import STOP_TIMEOUT
    from kimi_mlx.cluster.tensor.relay import PARK_AFTER
    from kimi_mlx.testing.idle import IdleGroup

    with IdleGroup(ckpt) as g:
        g.command()
        time.sleep(PARK_AFTER + 1.0)
        t0 = time.monotonic()
        g.node_rank.kill("the test stops it")
        took = time.monotonic() - t0
        assert g.rank1.returncode == 0, g.rank1.returncode
        assert took < STOP_TIMEOUT / 2, took
        assert g.node_rank.state() == "finished"
        t0 = time.monotonic()
        g.rank0.kill()
        took = time.monotonic() - t0
        assert g.rank0.proc.returncode == 0, g.rank0.proc.returncode
        assert took < STOP_TIMEOUT / 2, took
        assert g.rank0.state() is None  # stopped by this process, not a fault


def test_spare_rank0_stops_cleanly():
    """The spare rank 0 process (imported, waiting for a group's settings) is stopped by
    `stop_spare` with a clean exit, also when it gets SIGTERM before its socket closes."""
    from kimi_mlx.cluster.tensor import relay

    relay.start_spare()
    proc, conn = relay._spare
    try:
        assert conn.poll(120), "the spare did not finish importing"
        assert conn.recv_bytes() == b"I"
        os.kill(proc.pid, signal.SIGTERM)  # a SIGTERM while it waits: exit 0
        assert proc.wait(30) == 0
    finally:
        relay.stop_spare()
    relay.start_spare()
    proc = relay._spare[0]
    relay.stop_spare()
    assert proc.returncode == 0, proc.returncode

"""The hop bench's floors (kimi_mlx.cluster.bench.grpc_floor): every bare transport and relay
chain hands back the message it was sent, in order and whole (values checked inside each
variant's loop), and the figures come out for every variant (no timing asserted)."""

import pytest

from kimi_mlx.cluster.bench import grpc_floor
from kimi_mlx.cluster.bench.grpc_floor import FloorBench


def test_every_floor_variant_delivers_its_messages(tmp_path):
    bench = FloorBench(tmp_path, payload=3000, n=4)
    try:
        bench.round()  # warm-up round: checks values, not counted
        bench.round()
    finally:
        bench.close()
    floors = {f.name for f in bench.floors()}
    assert floors == {"sync stream (queue-fed)", "sync unary", "aio stream", "aio unary",
                      "aio stream, sync server", "tcp"}
    relays = {f.name: f for f in bench.relays()}
    assert set(relays) == {"sync relay", "sync relay + hand-off", "aio relay",
                           "aio relay + hand-off"}
    assert all(f.rt1_ms > 0 and f.rt3_ms > 0 for f in relays.values())


def test_a_wrong_reply_is_reported():
    from kimi_mlx.cluster.net import stage_pb2 as pb

    m = pb.Activation(seq=3)
    m.tensor.data = bytes(10)
    grpc_floor._check(m, 3, 10)
    with pytest.raises(RuntimeError, match="got message 3 of 10 bytes back, expected message 4"):
        grpc_floor._check(m, 4, 10)
    with pytest.raises(RuntimeError, match="expected message 3 of 11 bytes"):
        grpc_floor._check(m, 3, 11)

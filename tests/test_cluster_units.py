"""Cluster pieces without processes or network: wire format, auth, fingerprints, TXT
records, prefill chunking, and the stage runner composing to the full model in-process."""

import os
import stat
import time

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net.auth import AuthError, Verifier, init_secret, key_id, load_secret, sign
from kimi_mlx.cluster.net.discovery import NodeInfo, from_properties, interface_addresses, to_properties
from kimi_mlx.cluster.net.fingerprint import fingerprint, scan
from kimi_mlx.cluster.net.nodes import parse_address
from kimi_mlx.cluster.net.session import prefill_chunks
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.node.runner import Refused, StageRunner, StageSpec
from kimi_mlx.cluster.net.wire import WireError, from_tensor, to_tensor


# -- wire ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int32])
def test_tensor_round_trip_is_exact(dtype):
    x = (mx.random.normal((3, 1, 5, 8)) * 100).astype(dtype)
    t = to_tensor(x)
    y = from_tensor(pb.Tensor.FromString(t.SerializeToString()), (3, 1, 5, 8), t.dtype)
    assert y.dtype == dtype and mx.array_equal(x, y).item()


def test_tensor_checks_dtype_shape_and_bytes():
    t = to_tensor(mx.zeros((2, 1, 4, 8)))
    with pytest.raises(WireError, match="dtype float32, expected bfloat16"):
        from_tensor(t, (2, 1, 4, 8), "bfloat16")
    with pytest.raises(WireError, match=r"shape \[2, 1, 4, 8\], expected \[3, 1, 4, 8\]"):
        from_tensor(t, (3, 1, 4, 8), "float32")
    t.data = t.data[:-4]
    with pytest.raises(WireError, match="252 bytes, expected 256"):
        from_tensor(t, (2, 1, 4, 8), "float32")
    assert from_tensor(to_tensor(mx.zeros((7,))), (None,), "float32").shape == (7,)


# -- auth ------------------------------------------------------------------------------

def test_secret_file_is_private_and_checked(tmp_path):
    path = init_secret(tmp_path / "d" / "cluster.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret(path)
    assert len(secret) == 64
    with pytest.raises(FileExistsError):
        init_secret(path)
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        load_secret(path)
    with pytest.raises(AuthError, match="cluster init"):
        load_secret(tmp_path / "missing.key")


def test_call_tokens_refuse_wrong_secret_replay_skew_and_other_method():
    a, b = b"a" * 64, b"b" * 64
    v = Verifier(a)
    tok = sign(a, "/kimimlx.stage.v1.Stage/Health")
    assert v.check("/kimimlx.stage.v1.Stage/Health", tok) is None
    assert v.check("/kimimlx.stage.v1.Stage/Health", tok) == "replayed credentials"
    assert v.check("/kimimlx.stage.v1.Stage/Load", sign(a, "/kimimlx.stage.v1.Stage/Health")) \
        == "wrong cluster secret"
    assert v.check("/m", sign(b, "/m")) == "wrong cluster secret"
    assert "clock off" in v.check("/m", sign(a, "/m", now=time.time() - 3600))
    assert v.check("/m", None).startswith("no credentials")
    assert v.check("/m", "garbage") == "malformed credentials"
    assert key_id(a) != key_id(b) and len(key_id(a)) == 8


# -- fingerprints ------------------------------------------------------------------------

def test_fingerprint_tells_weights_apart_and_scan_finds_nested(tiny_ckpt, tmp_path):
    import shutil

    from kimi_mlx.testing.checkpoints import build_checkpoint

    other = build_checkpoint(tmp_path / "models" / "org" / "other", seed=1)
    shutil.copytree(tiny_ckpt, tmp_path / "models" / "copy")
    fp0, fp1 = fingerprint(tiny_ckpt), fingerprint(other)
    assert fp0 != fp1 and len(fp0) == 24
    assert fingerprint(tmp_path / "models" / "copy") == fp0
    found = scan(tmp_path / "models", include_shipped=False)
    assert found == {fp0: (tmp_path / "models" / "copy").resolve(), fp1: other.resolve()}


# -- discovery records -------------------------------------------------------------------

def test_txt_properties_round_trip():
    n = NodeInfo("mac-1", "10.0.0.2", 52415, protocol=1, version="0.1.0", mlx_version="0.32.4",
                 total_memory=512 << 30, usable_memory=496 << 30, chip="m3-ultra",
                 bandwidth=819 * 10**9, fingerprints=["a" * 24, "b" * 24], key_id="12345678")
    props = {k.encode(): v.encode() for k, v in to_properties(n).items()}
    assert all(len(k) + len(v) < 255 for k, v in props.items())
    back = from_properties(props, "10.0.0.2", 52415)
    assert back == n
    node = back.planner_node()
    assert node.usable_bytes == 496 << 30 and node.bandwidth_bytes_per_s == 819 * 10**9
    assert interface_addresses("127.0.0.1") == ["127.0.0.1"]
    with pytest.raises(ValueError, match="no interface"):
        interface_addresses("no-such-if0")


def test_prefill_chunks_and_addresses():
    assert prefill_chunks(1, 4) == []
    assert prefill_chunks(10, 4) == [(0, 4), (4, 4), (8, 1)]
    assert prefill_chunks(9, 4) == [(0, 4), (4, 4)]
    assert parse_address("mac2", 52415) == ("mac2", 52415)
    assert parse_address("10.0.0.3:7000", 1) == ("10.0.0.3", 7000)
    assert parse_address("[fe80::1]:9", 1) == ("fe80::1", 9)
    with pytest.raises(ValueError):
        parse_address("h:x", 1)


# -- stage runner (in-process) -------------------------------------------------------------

def test_runners_compose_to_the_full_model_bitwise_and_refuse_bad_order(tiny_ckpt):
    """Three StageRunners with hops through the wire format give generate_step's logprobs."""
    from mlx_lm.generate import generate_step

    from kimi_mlx.cluster.node.runner import load_stage
    from kimi_mlx.checkpoint.loader import load_model

    fp = fingerprint(tiny_ckpt)
    ranges = [(0, 2), (2, 5), (5, 6)]
    runners = [load_stage(tiny_ckpt, StageSpec(fp, s, e, i, 3, "float32", "float32"))[0]
               for i, (s, e) in enumerate(ranges)]
    sessions = [r.new_session("s", "h", Sampling(), return_logprobs=True) for r in runners]
    prompt = [5, 17, 99, 3, 250, 42, 7, 11]

    def through(seq, offset, ids, sample):
        x = mx.array([ids], dtype=mx.int32)
        for r, s in zip(runners, sessions):
            if not r.is_first:
                shape, dtype = r.input_spec(len(ids))
                x = from_tensor(to_tensor(x), shape, dtype)
            out = r.run(s, seq, offset, x, sample)
            x = out.hidden
        return out

    through(0, 0, prompt[:4], False)
    through(1, 4, prompt[4:7], False)
    out = through(2, 7, prompt[7:], True)
    model, _, _ = load_model(tiny_ckpt, verbose=False)
    tok, lp = next(generate_step(mx.array(prompt), model, prefill_step_size=4))
    assert out.token == tok and np.array_equal(np.array(out.logprobs), np.array(lp))
    assert runners[2].in_banks == 3 and runners[0].out_banks == 1  # block size 2
    with pytest.raises(Refused, match="sequence number 5, expected 3"):
        runners[1].run(sessions[1], 5, 8, mx.zeros((2, 1, 1, 64)), False)
    with pytest.raises(Refused, match="position 3, expected 8"):
        runners[1].run(sessions[1], 3, 3, mx.zeros((2, 1, 1, 64)), False)
    with pytest.raises(Refused, match="token id out of range"):
        runners[0].run(sessions[0], 3, 8, mx.array([[100000]], dtype=mx.int32), False)
    assert sessions[0].next_seq == 3  # refused messages change nothing
    # a scored chunk: one target per position, a prefill chunk, ids in the vocabulary
    h = mx.zeros(runners[2].input_spec(1)[0])
    with pytest.raises(Refused, match="needs 1 score targets and score_top in 0..20, got 2"):
        runners[2].run(sessions[2], 3, 8, h, False, score=([1, 2], 3))
    with pytest.raises(Refused, match="a scored chunk is a prefill chunk"):
        runners[2].run(sessions[2], 3, 8, h, True, score=([1], 3))
    with pytest.raises(Refused, match="score targets must be token ids"):
        runners[2].run(sessions[2], 3, 8, h, False, score=([10**6], 3))
    assert sessions[2].next_seq == 3


# -- TLS (in-process service) --------------------------------------------------------------

@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl command")
def test_tls_service_refuses_plaintext(tmp_path):
    import grpc

    from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
    from kimi_mlx.cluster.net.auth import init_tls
    from kimi_mlx.cluster.net.channel import make_channel
    from kimi_mlx.cluster.node.server import StageServer
    from kimi_mlx.cluster.node.service import StageService

    key = init_secret(tmp_path / "cluster.key")
    crt, tls_key = init_tls(key)
    assert stat.S_IMODE(tls_key.stat().st_mode) == 0o600
    secret = load_secret(key)
    service = StageService("tls-node", tmp_path, secret, tls_secret_path=key)
    server = StageServer(service, ["127.0.0.1"], 0, secret, tls_secret_path=key).start()
    try:
        addr = f"127.0.0.1:{server.port}"
        reply = pb_grpc.StageStub(make_channel(addr, secret, key)).Health(pb.HealthRequest(), timeout=10)
        assert reply.node_id == "tls-node"
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.StageStub(make_channel(addr, secret)).Health(pb.HealthRequest(), timeout=3)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop(0)


def test_cluster_init_then_tls_keeps_the_secret_and_says_how_to_copy(tmp_path, capsys):
    """`cluster init` writes a 0600 secret and a copy hint that makes the folder first;
    a second plain init is refused; `init --tls` afterwards adds the certificate and keeps
    the secret every node already holds."""
    import shutil

    from kimi_mlx.commands import main as cli

    key = tmp_path / ".kimi-mlx" / "cluster.key"
    assert cli.main(["cluster", "init", "--secret-file", str(key)]) == 0
    out = capsys.readouterr().out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"mkdir -m700 -p {key.parent} && scp -p {key} OTHER-MAC:{key.parent}/" in out
    secret = key.read_bytes()
    assert cli.main(["cluster", "init", "--secret-file", str(key)]) == 1
    assert "exists; use --force" in capsys.readouterr().err
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command for the TLS part")
    assert cli.main(["cluster", "init", "--tls", "--secret-file", str(key)]) == 0
    assert key.read_bytes() == secret
    assert (key.parent / "cluster.crt").exists() and (key.parent / "cluster.tls.key").exists()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "70000", "--no-advertise"], "--port must be in 0..65535"),
    (["serve", "--models", "/nonexistent/models", "--no-advertise"], "/nonexistent/models: no such folder"),
    (["serve", "--max-sessions", "0", "--no-advertise"], "--max-sessions and --max-message-mb must be >= 1"),
    (["ls", "--timeout", "-1"], "--timeout -1 is too short to hear any node"),
    (["ls", "--timeout", "0.1"], "random 20-120 ms"),
    (["launch", "--prompt", "hi", "--discover-timeout", "0.2"], "--discover-timeout 0.2 is too short"),
])
def test_cluster_flags_out_of_range_are_refused_before_anything_starts(capsys, argv, message):
    from kimi_mlx.commands import main as cli

    assert cli.main(["cluster", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cluster_flags_become_typed_settings_once(tmp_path):
    """`cluster launch` / `serve` flags reach the libraries as frozen settings, each field
    the flag's meaning (not an argparse Namespace the libraries could read or change)."""
    import argparse
    import dataclasses

    from kimi_mlx.cluster import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    key = tmp_path / "k"
    a = p.parse_args(["launch", "--prompt", "hi", "--nodes", "h1:5,h2", "--allow-version-mismatch",
                      "--tls", "--secret-file", str(key), "--peer-timeout", "7", "--replan",
                      "--sequences", "3", "--wire-dtype", "bfloat16", "--prefill-chunk", "64"])
    n, pl = cli.node_settings(a), cli.pipeline_settings(a)
    assert (n.nodes, n.check_version, n.replan, n.peer_timeout, n.tls_secret_path) == \
        ("h1:5,h2", False, True, 7.0, key)
    assert (pl.sequences, pl.wire_dtype, pl.activation_dtype, pl.prefill_chunk, pl.force_load) == \
        (3, "bfloat16", "auto", 64, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.replan = False
    s = cli.serve_settings(p.parse_args(["serve", "--no-advertise", "--port", "0",
                                         "--cache-bytes", "8GB", "--secret-file", str(key)]))
    assert (s.advertise, s.port, s.cache_bytes, s.tls, s.max_sessions) == (False, 0, "8GB", False, 16)
    no_tls = cli.node_settings(p.parse_args(["server", "--secret-file", str(key)]))
    assert no_tls.tls_secret_path is None and no_tls.nodes == "auto" and no_tls.check_version

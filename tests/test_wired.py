"""MLX's wired limit in every process that holds weights, on a faked Mac.

Each product process runs as its own process with `kimi_mlx.testing.fake_metal`'s device
(installed by a sitecustomize on PYTHONPATH), which records every `set_wired_limit`. The
recorded limit is held to an independent figure: the checkpoint's shard file sizes (or,
for one stage, the tensors of its layers read from the safetensors headers here; for a
tensor rank, the bytes of its slices as the loader reads them) plus the cache worked out
by hand from config.json (K31_SPEC.md section 4).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_mlx.generation.generate import default_model
from kimi_mlx.testing import fake_metal

MICRO = default_model()
pytestmark = pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")

MiB, GiB = 2**20, 2**30
# mx.device_info() of a 64 GB Apple-silicon Mac (fixture: tests/data/macos/device_info_64gb.json)
MAC64 = json.loads((Path(__file__).parent / "data" / "macos" / "device_info_64gb.json").read_text())
PY = sys.executable


# -- the independent figures ------------------------------------------------------------

def _shards(folder: Path):
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(".safetensors"))


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def file_weight_bytes(folder: Path) -> int:
    """Tensor bytes of a checkpoint from its files: each shard's size minus its 8-byte
    length and JSON header."""
    total = 0
    for p in _shards(folder):
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        total += p.stat().st_size - 8 - n
    return total


def layer_weight_bytes(folder: Path, start: int, end: int, n_layers: int) -> int:
    """Tensor bytes of layers [start, end) from the headers' data_offsets, the embedding
    with layer 0, everything else outside the layers (norm, output mix, lm_head) with the
    last."""
    total = 0
    for p in _shards(folder):
        for name, t in _header(p).items():
            if name == "__metadata__":
                continue
            size = t["data_offsets"][1] - t["data_offsets"][0]
            m = re.search(r"\.layers\.(\d+)\.", name)
            if m:
                total += size if start <= int(m.group(1)) < end else 0
            elif "embed_tokens" in name:
                total += size if start == 0 else 0
            else:
                total += size if end == n_layers else 0
    return total


def text_config(folder: Path) -> dict:
    c = json.loads((Path(folder) / "config.json").read_text())
    return c.get("text_config", c)


def cache_by_hand(folder: Path, tokens: int, sequences: int = 1, layers=None,
                  kda_share: float = 1.0, vector_bytes=lambda values: 2 * values) -> int:
    """K31_SPEC.md s.4 with bf16 activations: a KDA layer holds a conv state (kernel-1) x
    3 x heads x head_dim (bf16) and a recurrent state heads x head_dim^2 (fp32) per
    sequence; an attention layer (1-based ids in full_attn_layers) holds the latent and
    rope key, plus the index key on a DSA layer, per token. `vector_bytes(values)`: what
    the cache keeps for one latent or index-key vector (BF16 by default); the rope key
    stays BF16."""
    c = text_config(folder)
    lin, dsa = c["linear_attn_config"], c.get("dsa_config") or {}
    h, d, k = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    kda_state = (k - 1) * 3 * h * d * 2 + h * d * d * 4
    total = 0
    for i in (layers if layers is not None else range(c["num_hidden_layers"])):
        if i + 1 in lin["kda_layers"]:
            total += sequences * int(kda_state * kda_share)
        else:
            per_token = vector_bytes(c["kv_lora_rank"]) + c["qk_rope_head_dim"] * 2
            if i + 1 in dsa.get("dsa_layers", []):
                per_token += vector_bytes(dsa["index_head_dim"])
            total += sequences * per_token * tokens
    return total


def sysctl_mb(planned: int) -> int:
    """The MiB a user must set so `planned` fits under the planner's headroom (10%, at
    least 2 GiB): checked below against the planner itself."""
    from kimi_mlx.placement.planner import Node, StagePlanner

    n = planned // MiB
    while StagePlanner()._budget(Node("mac", n * MiB, 1)) < planned:
        n += 1
    return n


# -- running processes with the fake device ---------------------------------------------

def _wait_records(path, pred, proc=None, timeout=240.0, loaded=None):
    """The records once `pred` holds; fails at once when the process ended or `loaded()`
    says it has loaded (the limit is set before loading) without them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = fake_metal.records(path)
        if pred(recs):
            return recs
        if loaded is not None and loaded():
            recs = fake_metal.records(path)
            assert pred(recs), f"loaded with no wired limit set before: {recs}"
            return recs
        if proc is not None and proc.poll() is not None:
            recs = fake_metal.records(path)
            if pred(recs):
                return recs
            raise AssertionError(f"process ended ({proc.returncode}) before setting a wired "
                                 f"limit: {recs}")
        time.sleep(0.2)
    raise AssertionError(f"no wired limit recorded in {timeout} s: {fake_metal.records(path)}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=20)


def _run(args, rec, info=MAC64, timeout=300, extra_env=None):
    env = fake_metal.env(info, rec)
    env.update(extra_env or {})
    return subprocess.run([PY, "-m", "kimi_mlx"] + args, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_generate_wires_weights_plus_cache_and_restores(tmp_path):
    rec = tmp_path / "calls.jsonl"
    r = _run(["generate", "--prompt", "def", "--max-tokens", "2", "--max-kv-size", "512",
              "--ignore-chat-template"], rec)
    assert r.returncode == 0, r.stderr
    want = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 512)
    calls = fake_metal.records(rec)
    assert [c["limit"] for c in calls] == [want, 0], calls  # set before loading, restored at exit
    assert calls[0]["old"] == 0


def test_chat_wires_weights_plus_cache(tmp_path):
    rec = tmp_path / "calls.jsonl"
    env = fake_metal.env(MAC64, rec)
    r = subprocess.run([PY, "-m", "kimi_mlx", "chat", "--max-kv-size", "256", "--quiet"],
                       env=env, input="", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    want = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 256)
    assert [c["limit"] for c in fake_metal.records(rec)] == [want, 0]


def test_prune_pass_wires_its_largest_layer(tmp_path):
    rec = tmp_path / "calls.jsonl"
    r = _run(["prune", "--model", str(MICRO), "--method", "random", "--keep", "0.5",
              "--out", str(tmp_path / "out"), "--quiet"], rec)
    assert r.returncode == 0, r.stderr
    n = text_config(MICRO)["num_hidden_layers"]
    # one layer at a time, the first with the embedding; no calibration: no activations
    # each layer's tensors (n + 1 layers: the head is never counted), layer 0's with the
    # embedding
    largest = max(layer_weight_bytes(MICRO, i, i + 1, n + 1) for i in range(n))
    assert [c["limit"] for c in fake_metal.records(rec)] == [largest, 0]


def test_eval_wires_its_windows(tmp_path):
    rec = tmp_path / "calls.jsonl"
    data = tmp_path / "text.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 8)
    r = _run(["eval", "--data", str(data), "--seq-len", "16", "--batch-size", "3", "--quiet"], rec)
    assert r.returncode == 0, r.stderr
    want = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 17, sequences=3)
    assert [c["limit"] for c in fake_metal.records(rec)] == [want, 0]


def test_server_wires_before_loading(tmp_path):
    from kimi_mlx.testing.ports import free_ports

    rec = tmp_path / "calls.jsonl"
    port = free_ports(1)[0]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([PY, "-m", "kimi_mlx", "server", "--port", str(port),
                                 "--max-concurrency", "2", "--max-kv-size", "1024", "--quiet",
                                 "--log-level", "INFO"],
                                env=fake_metal.env(MAC64, rec), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        calls = _wait_records(rec, lambda r: len(r) >= 1, proc,
                              loaded=lambda: "serving" in log.read_text())
    finally:
        _kill(proc)
    want = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 1024, sequences=2)
    assert calls[0]["limit"] == want and calls[0]["pid"] == proc.pid
    assert fake_metal.records(rec)[-1]["limit"] == 0  # SIGTERM: restored at exit


def test_pipeline_stages_wire_their_layers(tmp_path):
    from kimi_mlx.testing.cluster import LocalCluster

    rec = tmp_path / "calls.jsonl"
    cluster = LocalCluster(tmp_path, n=2, ckpt=MICRO, env=fake_metal.env(MAC64, rec, base={}))
    try:
        transport, stages = cluster.load_transport()
        transport.shutdown()
        calls = _wait_records(rec, lambda r: len(r) >= 2, loaded=lambda: True)
        by_pid = {c["pid"]: c["limit"] for c in calls}
        n = cluster.args.num_hidden_layers
        trained = text_config(MICRO)["max_position_embeddings"]
        for proc, st in zip(cluster.procs, stages):
            want = (layer_weight_bytes(MICRO, st.start, st.end, n)
                    + cache_by_hand(MICRO, trained, layers=range(st.start, st.end)))
            assert by_pid[proc.proc.pid] == want, (st, calls)
        assert len(stages) == 2 and stages[0].end == stages[1].start
    finally:
        cluster.stop()


class _Group:
    """What `load_sharded` asks of a group: its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _start_ranks(tmp_path, device: dict, rec, procs: list, logs: list) -> None:
    """Start ranks 0 and 1 of a 2-rank ring group on micro (`python -m
    kimi_mlx.cluster.tensor.rank`), each on the fake Metal `device` recording into `rec`,
    appending each process to `procs` as it starts (so the caller's `finally` kills what
    did start) with its output in `logs[r]`."""
    from kimi_mlx.testing.ports import free_ports
    from kimi_mlx.testing.tensor_parallel import write_hostfile

    hosts = write_hostfile(tmp_path / "hosts.json", free_ports(2))
    for r in range(2):
        env = fake_metal.env(device, rec)
        env.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hosts))
        with open(logs[r], "w") as out:
            procs.append(subprocess.Popen(
                [PY, "-m", "kimi_mlx.cluster.tensor.rank", "--model", str(MICRO),
                 "--backend", "ring", "--name", f"n{r}", "--cache-bytes", "0"],
                env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                start_new_session=True))


def test_tensor_rank_other_than_zero_wires_its_slices(tmp_path):
    from kimi_mlx.checkpoint.ranged import load_sharded

    rec = tmp_path / "calls.jsonl"
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    try:
        _start_ranks(tmp_path, MAC64, rec, procs, logs)
        calls = _wait_records(rec, lambda rs: {c["pid"] for c in rs} >= {p.pid for p in procs},
                              timeout=240,
                              loaded=lambda: all("loaded its slices" in l.read_text() for l in logs))
    finally:
        for p in procs:
            _kill(p)
    by_pid = {c["pid"]: c["limit"] for c in calls}
    trained = text_config(MICRO)["max_position_embeddings"]
    for r, p in enumerate(procs):
        _, stats = load_sharded(MICRO, _Group(2, r))  # the bytes of its slices, as read
        want = stats["needed"] + cache_by_hand(MICRO, trained, kda_share=0.5)
        assert by_pid[p.pid] == want, (r, calls)


# -- refusing, and going on with the flag -------------------------------------------------

def _small_mac(limit_bytes: int) -> dict:
    return dict(MAC64, max_recommended_working_set_size=limit_bytes)


def test_refuses_with_one_sysctl_line_when_the_plan_does_not_fit(tmp_path):
    rec = tmp_path / "calls.jsonl"
    small = _small_mac(4 * MiB)  # the micro model needs ~7.4 MiB at 4096 tokens
    r = _run(["generate", "--prompt", "def", "--max-tokens", "1"], rec, info=small)
    assert r.returncode == 2
    planned = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 4096)
    lines = [l for l in r.stderr.splitlines() if "sysctl" in l]
    assert len(lines) == 1, r.stderr
    assert f"sudo sysctl iogpu.wired_limit_mb={sysctl_mb(planned)}`" in lines[0]
    assert "--allow-paging" in lines[0]
    assert fake_metal.records(rec) == []  # nothing wired, nothing loaded


def test_allow_paging_goes_on_with_a_warning(tmp_path):
    rec = tmp_path / "calls.jsonl"
    small = _small_mac(4 * MiB)
    r = _run(["generate", "--prompt", "def", "--max-tokens", "1", "--ignore-chat-template",
              "--allow-paging"], rec, info=small)
    assert r.returncode == 0, r.stderr
    assert "going on paged" in r.stderr
    assert [c["limit"] for c in fake_metal.records(rec)] == [4 * MiB, 0]
    rec.unlink()
    r = _run(["generate", "--prompt", "def", "--max-tokens", "1", "--ignore-chat-template"], rec,
             info=small, extra_env={"KIMI_MLX_ALLOW_PAGING": "1"})
    assert r.returncode == 0, r.stderr
    assert [c["limit"] for c in fake_metal.records(rec)] == [4 * MiB, 0]


def test_sysctl_figure_is_what_the_planner_needs():
    from kimi_mlx.placement.planner import Node, StagePlanner
    from kimi_mlx.placement.wired import limit_mb_for

    for planned in (1, 7_709_952, 19 * GiB, 100 * GiB + 12345, 470 * GiB):
        n = limit_mb_for(planned)
        assert n == sysctl_mb(planned)
        assert StagePlanner()._budget(Node("mac", n * MiB, 1)) >= planned
        assert StagePlanner()._budget(Node("mac", (n - 1) * MiB, 1)) < planned


def test_no_metal_is_a_logged_no_op(caplog, monkeypatch):
    import mlx.core as mx

    from kimi_mlx.placement import wired

    monkeypatch.setattr(wired, "mx", mx)
    if mx.metal.is_available():
        pytest.skip("this machine has Metal")
    with caplog.at_level(logging.DEBUG, logger="kimi_mlx.placement.wired"):
        assert wired.wire(wired.WiredPlan("kimi-mlx generate", 10 * GiB, GiB)) is None
    assert any("no Metal" in r.message and r.levelno == logging.DEBUG for r in caplog.records)


def test_prune_refuses_in_one_line(tmp_path, monkeypatch):
    from kimi_mlx.placement import wired
    from kimi_mlx.prune.pipeline import _wire_prune
    from kimi_mlx.prune.writer import PruneError, source_args

    rec = tmp_path / "calls.jsonl"
    monkeypatch.setattr(wired, "mx", wired.mx)  # put back after the test
    monkeypatch.setattr(wired, "_saved", None)
    fake_metal.install(_small_mac(MiB), str(rec))
    monkeypatch.delenv(wired.ALLOW_PAGING_ENV, raising=False)
    _, args, _ = source_args(MICRO)
    with pytest.raises(PruneError, match=r"^\d+\.\d\d MiB to wire \(weights .*sudo sysctl iogpu\.wired_limit_mb=\d+`"):
        _wire_prune(MICRO, args, 4096, 2, 0, 0)
    fake_metal.install(MAC64, str(rec))
    _wire_prune(MICRO, args, 4096, 2, 0, 0)
    limit = fake_metal.records(rec)[-1]["limit"]
    # the largest layer as stored, plus activations: more than one layer, less than all
    assert max(layer_weight_bytes(MICRO, i, i + 1, args.num_hidden_layers)
               for i in range(args.num_hidden_layers)) < limit
    wired.restore()
    assert fake_metal.records(rec)[-1]["limit"] == 0


def test_a_stage_that_does_not_fit_refuses_its_load_in_one_line(tmp_path):
    from kimi_mlx.testing.cluster import LocalCluster

    rec = tmp_path / "calls.jsonl"
    cluster = LocalCluster(tmp_path, n=1, ckpt=MICRO,
                           env=fake_metal.env(_small_mac(2 * MiB), rec, base={}))
    try:
        with pytest.raises(Exception) as e:
            t, _ = cluster.load_transport()
            t.shutdown()
        msg = str(e.value)
        planned = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 4096)  # one stage: all of it
        assert f"sudo sysctl iogpu.wired_limit_mb={sysctl_mb(planned)}`" in msg, msg
        assert "layers [0, 6)" in msg and "\n" not in msg.strip(), msg
        assert fake_metal.records(rec) == []
    finally:
        cluster.stop()


def test_a_rank_that_does_not_fit_exits_naming_the_sysctl(tmp_path):
    from kimi_mlx.checkpoint.ranged import load_sharded

    rec = tmp_path / "calls.jsonl"
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    try:
        _start_ranks(tmp_path, _small_mac(MiB), rec, procs, logs)
        assert procs[1].wait(timeout=240) == 1
    finally:
        for p in procs:
            _kill(p)
    _, stats = load_sharded(MICRO, _Group(2, 1))
    planned = stats["needed"] + cache_by_hand(MICRO, text_config(MICRO)["max_position_embeddings"],
                                              kda_share=0.5)
    lines = [l for l in logs[1].read_text().splitlines() if "sysctl" in l]
    assert len(lines) == 1 and lines[0].startswith("[tensor] rank 1 on node n1: "), lines
    assert f"iogpu.wired_limit_mb={sysctl_mb(planned)}`" in lines[0]
    assert fake_metal.records(rec) == []


def test_the_plan_is_made_only_on_metal_and_a_bad_checkpoint_does_not_block(monkeypatch, tmp_path, caplog):
    import mlx.core as mx

    from kimi_mlx.checkpoint.shards import CheckpointError
    from kimi_mlx.placement import wired

    monkeypatch.setattr(wired, "mx", mx)
    monkeypatch.setattr(wired, "_saved", None)
    if not mx.metal.is_available():  # Linux: nothing is read from the checkpoint
        assert wired.wire(lambda: pytest.fail("planned without Metal")) is None
    fake_metal.install(MAC64, str(tmp_path / "rec.jsonl"))

    def bad():
        raise CheckpointError("/x/model.safetensors.index.json: shard 2 is missing")

    with caplog.at_level(logging.WARNING, logger="kimi_mlx.placement.wired"):
        assert wired.wire(bad) is None  # the load that follows names the missing shard
    assert "shard 2 is missing" in caplog.text
    assert fake_metal.records(tmp_path / "rec.jsonl") == []

"""Stops that free memory, and children that never outlive their parent
(`kimi_mlx.cluster.net.lifetime` and the commands that start processes).

- `stop_process`: SIGTERM first; a child that exits on it is reaped with status 0 and no
  SIGKILL; one that ignores SIGTERM is SIGKILLed only after the bound.
- A `cluster serve` stage started by a harness (`testing.cluster.StageProc`) whose
  starting process is SIGKILLed ends itself (it watches its parent) with a clean stop.
- `kimi-mlx bench spec` (small settings) ended by SIGTERM while its stage processes run:
  no process of it is left (found by the unique temp folder in their command lines) and
  its temporary folder is gone.

Hard timeouts on every wait; processes this file starts are ended in `finally`.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kimi_mlx.cluster.net.lifetime import stop_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process tables read from /proc")


def _py(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], **kw)


def _wait_line(path: Path, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout:.0f} s")


def _pids_with(marker: str):
    """Live (not zombie) processes whose command line contains `marker`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append((int(d), cmd))
    return out


def test_sigterm_first_clean_exit(tmp_path):
    ready = tmp_path / "ready"
    p = _py(f"""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        open({str(ready)!r}, "w").write("ready")
        while True:
            time.sleep(0.1)
    """)
    try:
        _wait_line(ready, "ready", 60)
        t0 = time.monotonic()
        assert stop_process(p, timeout=20) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigkill_only_after_the_bound_for_a_child_that_ignores_sigterm(tmp_path):
    ready = tmp_path / "ready"
    p = _py(f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").write("ready")
        while True:
            time.sleep(0.1)
    """)
    try:
        _wait_line(ready, "ready", 60)
        t0 = time.monotonic()
        assert stop_process(p, timeout=1.5) == -signal.SIGKILL
        assert time.monotonic() - t0 >= 1.5
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stage_ends_when_its_starter_is_killed(tmp_path):
    """A harness process starts one `cluster serve` stage (`StageProc`), then is
    SIGKILLed: its `finally` never runs, yet the stage stops by itself within the parent
    poll plus its stop."""
    from kimi_mlx.testing.cluster import reference_checkpoint

    ckpt = reference_checkpoint(tmp_path)
    marker = tmp_path / "marker-models"
    marker.mkdir()
    (marker / "ckpt").symlink_to(ckpt)
    log = tmp_path / "stage.log"
    starter = _py(f"""
        import time
        from pathlib import Path
        from kimi_mlx.cluster.net.auth import init_secret
        from kimi_mlx.testing.cluster import StageProc
        secret = Path({str(tmp_path / 'secret')!r})
        init_secret(secret)
        s = StageProc(Path({str(marker)!r}), secret, "orphan", Path({str(log)!r})).start()
        s.wait_ready(120)
        open({str(tmp_path / 'ready')!r}, "w").write(str(s.proc.pid))
        time.sleep(600)
    """)
    try:
        end = time.monotonic() + 180
        while not (tmp_path / "ready").exists() or not (tmp_path / "ready").read_text():
            assert time.monotonic() < end and starter.poll() is None, "the stage did not start"
            time.sleep(0.1)
        stage = int((tmp_path / "ready").read_text())
        assert {p for p, _ in _pids_with(str(marker))} == {stage, starter.pid}  # (its -c code)
        starter.kill()
        starter.wait(10)
        end = time.monotonic() + 60
        while _pids_with(str(marker)) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _pids_with(str(marker)), log.read_text()[-2000:]
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for pid, _ in _pids_with(str(marker)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e  # the whole bench spec run up to its 2 stages, then SIGTERM: ~19 s quiet (make test-e2e)
def test_sigterm_to_bench_spec_leaves_no_process_and_no_folder(tmp_path):
    tmp = tmp_path / "tmpdir-bench-stop"  # unique: in every stage's command line
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    out = open(tmp_path / "bench.log", "wb")
    bench = subprocess.Popen(
        [sys.executable, "-m", "kimi_mlx.commands.main", "bench", "spec", "--drafts", "ngram",
         "--workloads", "ordinary", "--tokens", "4", "--ks", "1", "--ngram-ks", "2",
         "--prompts", "1", "--repeats", "1", "--copy-tokens", "4", "--stages", "2",
         "--stage-prompts", "1", "--stage-repeats", "1"],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 600
        folders = []
        while time.monotonic() < end and bench.poll() is None:
            folders = [f for f in tmp.iterdir() if f.name.startswith("kimi-mlx-spec-bench-")]
            logs = [f / f"specbench{i}.log" for f in folders for i in range(2)]
            if logs and all(l.exists() and "listening on" in l.read_text(errors="replace")
                            for l in logs):
                break
            time.sleep(0.1)
        assert bench.poll() is None, (tmp_path / "bench.log").read_text()[-3000:]
        assert folders and len(_pids_with(str(tmp))) >= 2, _pids_with(str(tmp))
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(120)
        assert code == 128 + signal.SIGTERM, (tmp_path / "bench.log").read_text()[-3000:]
        assert _pids_with(str(tmp)) == []
        assert [f for f in tmp.iterdir() if f.name.startswith("kimi-mlx-")] == []
    finally:
        out.close()
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid, _ in _pids_with(str(tmp)):
            os.kill(pid, signal.SIGKILL)


def test_node_stop_stops_its_running_ranks(tmp_path):
    """`cluster serve` stopping (`StageService.close`, after SIGTERM) stops every tensor
    rank it runs through `RankProcess.kill` (SIGTERM first), not only the ranks whose
    lease ended: none is left to the interpreter's exit."""
    from kimi_mlx.cluster.node.service import StageService

    svc = StageService("stopnode", tmp_path, b"k" * 32)
    stopped = []

    class Rank:
        def kill(self, why):
            stopped.append(why)

    svc._ranks.add(Rank())
    svc.close(timeout=10)
    assert stopped == ["the node is stopping"]

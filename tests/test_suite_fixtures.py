"""The suite's own machinery (tests/fixtures/): a timed-out test's stage processes are
killed (observed through the process's exit status), the per-test timeout and the
durations report are configured, and the start-up counter's sums equal a hand count."""

import json
import signal
import subprocess
import sys

from kimi_mlx.testing.cluster import StageProc

from fixtures import counting, timeouts


class _Sleeper(StageProc):
    """A StageProc whose process sleeps instead of serving (no model, no port)."""

    def command(self):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_timed_out_tests_stages_are_killed(tmp_path):
    p = _Sleeper(tmp_path, tmp_path / "key", "sleeper0", tmp_path / "sleeper.log").start()
    try:
        assert p.alive() and p in timeouts.started()
        # only this one: the session's shared stages serve on after this test
        assert timeouts.kill_children([p]) == 1
        assert p.proc.wait(10) == -signal.SIGKILL
        assert timeouts.kill_children([p]) == 0  # nothing of it left to kill
    finally:
        p.stop(timeout=1)


def test_timeout_and_durations_are_configured(pytestconfig):
    assert pytestconfig.getini("timeout") == "600"
    assert pytestconfig.getini("timeout_method") == "thread"
    out = subprocess.run([sys.executable, "-c", "import tomllib; print(tomllib.load(open("
                          "'pyproject.toml', 'rb'))['tool']['pytest']['ini_options']['addopts'])"],
                         capture_output=True, text=True, cwd=pytestconfig.rootpath, timeout=60)
    assert "--durations=25" in out.stdout, out


def test_counting_sums_per_module(tmp_path):
    f = tmp_path / "count.jsonl"
    events = [("cluster", "tests/test_a.py::t1 (setup)", {"n": 3})] + \
        [("stage", "tests/test_a.py::t1 (setup)", {"grouped": True})] * 3 + \
        [("stage", "tests/test_b.py::t2 (call)", {"grouped": False}),
         ("server", "tests/test_b.py::t2 (call)", {}), ("model", "tests/test_b.py::t3 (call)", {})]
    f.write_text("".join(json.dumps(dict(kind=k, test=t, **e)) + "\n" for k, t, e in events))
    lines = counting.summary(str(f)).splitlines()
    assert lines[0] == ("total: cluster 1, stage 4, stage_outside_start_stages 1, "
                        "cluster_server 0, server 1, model 1")
    assert lines[1] == "tests/test_a.py: cluster 1, stage 3"
    assert lines[2] == "tests/test_b.py: stage 1, stage_outside_start_stages 1, server 1, model 1"

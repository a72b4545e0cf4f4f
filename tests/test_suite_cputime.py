"""The per-test CPU recorder (tests/fixtures/cputime.py, KIMI_MLX_TEST_CPU): run on a
small suite of its own in a child pytest, a test that spins counts about its spin in CPU
seconds, one that sleeps counts its sleep in wall seconds and next to no CPU, a child
process's spin counts once the child is reaped, and a run cut short by a failure with -x
still leaves the rows of every test that ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = '''
import subprocess, sys, time

def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_spin():
    _spin(0.4)

def test_sleep():
    time.sleep(0.4)

def test_child():
    subprocess.run([sys.executable, "-c",
                    "import time\\nend = time.process_time() + 0.4\\n"
                    "while time.process_time() < end: pass"], check=True, timeout=60)

def test_fails():
    assert False

def test_never_runs():
    pass
'''


def test_cpu_and_wall_seconds_per_test(tmp_path):
    (tmp_path / "test_small.py").write_text(SUITE)
    out = tmp_path / "cpu.json"
    env = dict(os.environ, KIMI_MLX_TEST_CPU=str(out), PYTHONPATH=str(TESTS))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-p", "fixtures.cputime", "test_small.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert sorted(rows) == [f"test_small.py::test_{n}" for n in ("child", "fails", "sleep", "spin")]

    def total(name, i):
        return sum(p[i] for p in rows[f"test_small.py::test_{name}"].values())

    assert set(rows["test_small.py::test_spin"]) == {"setup", "call", "teardown"}
    assert 0.35 <= total("spin", 1) < 2.0
    assert total("sleep", 0) >= 0.39 and total("sleep", 1) < 0.2
    assert 0.35 <= total("child", 1)

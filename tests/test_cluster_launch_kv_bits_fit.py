"""`cluster launch --kv-bits 8` over 3 real stage processes that advertise 2 GiB + 50 MiB
of usable memory each (`cluster serve --usable-memory`) and m3-ultra bandwidth, planned for
64 sequences x 4096 tokens: the BF16 caches fit no split (one DSA layer's 64 x 4096 x 224
B = 58.7 MB is more than a node's 50 MiB above the planner's 2 GiB headroom, by hand from
micro's config.json: tests/test_cluster_plan_kv_bits.py), the 8-bit ones do. The launch
refuses BF16, places and runs the 8-bit cluster on the stage ranges that `kimi-mlx plan
--kv-bits 8` prints for the same Macs, and prints what `generate --kv-bits 8` prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kimi_mlx.placement.planner import GiB

MiB = 2**20
WIRED_MB = (2 * GiB + 50 * MiB) // MiB
PLAN = ["--context", "4096", "--sequences", "64"]


def _run(cmd, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main"] + cmd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _body(stdout: str) -> str:
    return "\n".join(l for l in stdout.splitlines()
                     if not l.startswith(("Prompt:", "Generation:", "Peak memory:")))


@pytest.fixture(scope="module")
def small_nodes(tmp_path_factory):
    from kimi_mlx.testing.cluster import LocalCluster
    from kimi_mlx.testing.ports import free_ports

    c = LocalCluster(tmp_path_factory.mktemp("kvfit"), 3, prefix="mac", ports=free_ports(3),
                     extra=["--usable-memory", f"{WIRED_MB * MiB}B", "--bandwidth-gbs", "819"])
    try:
        yield c
    finally:
        c.stop()


def test_launch_places_only_the_8bit_cluster_on_plans_ranges(small_nodes, micro_path):
    c = small_nodes
    nodes = ",".join(p.address for p in c.procs)
    flags = ["--model", str(c.ckpt), "--prompt", "The licence grants you the right to",
             "--max-tokens", "8", "--temp", "0", "--ignore-chat-template"]
    head = ["cluster", "launch", "--nodes", nodes, "--secret-file", str(c.secret_file)]

    bf16 = _run(head + flags + PLAN)
    assert bf16.returncode == 1 and "does not fit" in bf16.stderr, bf16.stderr

    launch = _run(head + flags + PLAN + ["--kv-bits", "8"])
    assert launch.returncode == 0, launch.stderr
    got = [(f"mac{int(n)}", int(s), int(e)) for n, s, e in
           re.findall(r"stage \d+ \(node mac(\d+) at [^,]+, layers \[(\d+), (\d+)\)\): "
                      r"[\d.]+ GB of",
                      launch.stderr)]
    assert "8-bit caches (group 128)" in launch.stderr

    plan = _run(["plan", "--model", str(c.ckpt), "--macs", "3x8GB", "--wired-limit-mb",
                 str(WIRED_MB), "--kv-bits", "8"] + PLAN)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    # plan names its Macs mac1..3 in order; the stages are mac0..2 in that order
    want = [(f"mac{int(n[3:]) - 1}", int(s), int(e)) for n, s, e in
            re.findall(r"^\d+\s+(mac\d+)\s+.*?\[(\d+), (\d+)\)", plan.stdout, re.M)]
    assert got == want and len(got) >= 2, (launch.stderr, plan.stdout)

    gen = _run(["generate"] + flags + ["--kv-bits", "8"])
    assert gen.returncode == 0, gen.stderr
    assert _body(launch.stdout) == _body(gen.stdout)

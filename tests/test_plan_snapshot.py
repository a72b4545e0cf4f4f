"""`kimi-mlx plan` states the bytes of one cluster prompt-cache snapshot per stage at
K3.1's size: at the full context they are that stage's cache for one sequence, which
the planner computes on its own (`Stage.cache_bytes`)."""

import argparse
import re

from kimi_mlx.commands import plan as plan_cmd


def test_plan_states_snapshot_bytes_per_stage(capsys):
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    args = p.parse_args(["--model", "moonshotai/Kimi-K3.1-Pro", "--macs", "4x512GB",
                         "--context", "131072"])
    assert plan_cmd.run(args) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("prompt-cache snapshot per stage"))
    at_context = [float(x) for x in re.search(r"at 131072 tokens: ([\d. /]+) GB", line).group(1).split(" / ")]
    cache_gb = [float(r.split()[-4]) for r in out.splitlines() if re.match(r"^\d\s+mac\d", r)]
    assert len(at_context) == 4 and at_context == cache_gb
    # the disk tier's files hold the same arrays: the same bytes per stage
    disk = next(l for l in out.splitlines() if l.startswith("prompt-cache snapshot on disk"))
    per_file = [float(x) for x in re.search(r"tokens: ([\d. /]+) GB per stage", disk).group(1).split(" / ")]
    assert per_file == at_context

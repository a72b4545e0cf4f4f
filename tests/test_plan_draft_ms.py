"""`kimi-mlx plan --drafts`: the drafter's time per verify step is a duration, so a
negative or non-finite `--draft-ms` is refused naming the flag (a negative one used to be
taken, making drafting predict more than the drafts can give: at k the step cannot be
shorter than the target's own pass), and every bad draft flag is refused before any
output rather than after the placement tables."""

import argparse

import pytest

from kimi_mlx.commands import plan as plan_cmd

BASE = ["--model", "moonshotai/Kimi-K3.1-Pro", "--macs", "4x512GB", "--q-bits", "4",
        "--kv-bits", "8", "--drafts"]


def _run(extra, capsys):
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    rc = plan_cmd.run(p.parse_args(BASE + extra))
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parametrize("ms", ["-1", "nan", "inf"])
def test_a_negative_or_non_finite_draft_time_is_refused_before_any_output(ms, capsys):
    rc, out, err = _run([f"--draft-ms={ms}"], capsys)
    assert rc == 2
    assert "--draft-ms" in err
    assert out == ""


def test_a_bad_acceptance_is_refused_before_any_output(capsys):
    rc, out, err = _run(["--draft-acceptance", "17"], capsys)
    assert rc == 2 and "acceptance length of 17" in err
    assert out == ""

"""`python -m kimi_mlx.testing.idle --compare`: a parked group against one that never parks,
in one run.

The comparison is only worth its figure when the second group really waits as before the
doorbell: its rank 1 must spin in `all_sum` through the idle time (CPU seconds from
/proc, the independent signal), the first group's must sleep; each group is timed after
every idle time, and the summary is the medians of those times. Linux only (/proc).
"""

import statistics
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="CPU time from /proc")

BOUND = 0.1  # CPU s of an idle rank over the window: parked ~0, spinning ~0.5-2 per second


@pytest.mark.timeout(600)
def test_compare_times_a_parked_and_a_never_parked_group(tmp_path, monkeypatch):
    import kimi_mlx.cluster.tensor.relay  # noqa: F401  (its PARK_AFTER read before the setenv)
    from kimi_mlx.testing.cluster import reference_checkpoint
    from kimi_mlx.testing.idle import PARK_ENV, compare

    monkeypatch.setenv(PARK_ENV, "inf")  # the parked group must not take this process's
    out = compare(reference_checkpoint(tmp_path), idle=3.0, window=2.0, repeats=2, cycles=2)
    for kind in ("parked", "never_parked"):
        assert len(out[kind]["first_ms"]) == 2 and len(out[kind]["warm_ms"]) == 2, out
        assert all(0 < t < 60_000 for t in out[kind]["first_ms"]), out
    assert out["parked"]["cpu_s"][0]["rank 1"] < BOUND, out
    assert out["never_parked"]["cpu_s"][0]["rank 1"] > BOUND, out
    med = {k: statistics.median(out[k]["first_ms"]) for k in ("parked", "never_parked")}
    assert out["median_first_ms"] == med
    assert out["difference_ms"] == med["parked"] - med["never_parked"]
    assert out["within_1ms"] == (out["difference_ms"] <= 1.0)  # signed: parked faster passes

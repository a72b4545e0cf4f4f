"""The tensor group's restore decision (`cluster.tensor.prompt_cache.agree_restore`) with
uneven stores: three ranks of MLX's ring backend on loopback, each with its own fake
store (which keys it holds, which restores fail), every rank running the same sequence
of decisions as the group's commands do. The expected prefix is computed here from the
stores alone: the longest key that EVERY rank holds (a set intersection), or none when a
rank has no store or any rank's restore of it fails. Rank 0's own flags are not enough:
a rank that holds only a shorter prefix must shorten the restore, not empty it, and no
rank may continue from a state another rank lacks."""

import json
import textwrap

import pytest

from kimi_mlx.testing.tensor_parallel import free_ports, run_ranks

HARD_TIMEOUT = 120


def key(n: int) -> str:
    return f"{n}-{n:032x}"


KEYS = [key(n) for n in (64, 48, 32, 16)]  # longest first, as the group offers them

# (what each of the 3 ranks holds (None: no store), the keys whose restore fails, by rank)
CASES = {
    "uneven": ([KEYS, KEYS[1:], KEYS[2:]], [[], [], []]),
    "rank 0 shortest": ([KEYS[3:], KEYS, KEYS[1:]], [[], [], []]),
    "holes": ([[KEYS[0], KEYS[2]], [KEYS[0], KEYS[1], KEYS[2]], [KEYS[2], KEYS[3]]], [[], [], []]),
    "only rank 0 holds": ([KEYS, [], KEYS[:1]], [[], [], []]),
    "no store on a rank": ([KEYS, None, KEYS], [[], [], []]),
    "a restore fails": ([KEYS, KEYS, KEYS[1:]], [[], [], [KEYS[1]]]),
}

RANK = textwrap.dedent('''
    import json, sys
    import mlx.core as mx
    from kimi_mlx.cluster.tensor.prompt_cache import agree_restore

    class FakeStore:
        """A rank's `KeyedSnapshotCache` as `agree_restore` uses it."""
        def __init__(self, held, failing):
            self._held, self.failing, self.restored = set(held), set(failing), []
        def held(self, keys):
            return [k for k in keys if k in self._held]
        def restore(self, key, length):
            self.restored.append(key)
            if key not in self._held or key in self.failing:
                return None  # as KeyedSnapshotCache.restore: None when not held / unusable
            return [("cache", key, length)]

    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    cases = json.loads(open(sys.argv[1]).read())
    keys = json.loads(sys.argv[2])
    out = {}
    for name, (held, failing) in cases.items():
        store = None if held[rank] is None else FakeStore(held[rank], failing[rank])
        cache, n = agree_restore(store, keys, group)
        out[name] = {"n": n, "cache": cache, "restored": store.restored if store else []}
    with open(sys.argv[3] + f"/rank{rank}.json", "w") as f:
        json.dump(out, f)
''')


def expected(held, failing):
    """The longest key every rank holds, 0 when none or when a rank's restore fails."""
    if any(h is None for h in held):
        return 0
    common = set(held[0]).intersection(*map(set, held[1:]))
    if not common:
        return 0
    pick = max(common, key=lambda k: int(k.split("-")[0]))
    return 0 if any(pick in f for f in failing) else int(pick.split("-")[0])


@pytest.fixture(scope="module")
def decisions(tmp_path_factory):
    work = tmp_path_factory.mktemp("agree")
    (work / "agree_rank.py").write_text(RANK)
    (work / "cases.json").write_text(json.dumps(CASES))
    run_ranks(free_ports(3), [str(work / "cases.json"), json.dumps(KEYS), str(work)], work,
              timeout=HARD_TIMEOUT, env={"PYTHONPATH": str(work)}, module="agree_rank")
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_restores_the_longest_prefix_all_ranks_hold(decisions, case):
    held, failing = CASES[case]
    want = expected(held, failing)
    got = [d[case] for d in decisions]
    assert [g["n"] for g in got] == [want] * 3, (case, got)
    for r, g in enumerate(got):
        if want:
            assert g["cache"] == [["cache", key(want), want]]  # this rank's own snapshot
        else:
            assert g["cache"] is None
        # no rank ever restored a prefix another rank does not hold
        assert all(k in set(held[0]).intersection(*map(set, held[1:]))
                   for k in g["restored"]) if all(h is not None for h in held) else True


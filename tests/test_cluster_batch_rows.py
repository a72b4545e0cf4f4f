"""A stage's batched decode step (`StageRunner.run_rows`), without processes: sessions
of different prompt lengths decoded together through two stages give each session the
tokens it gets decoded alone (greedy, and seeded sampling with each session's own PRNG
key), and a bad batch is refused before any compute."""

import mlx.core as mx
import pytest

from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.runner import Refused, StageSpec, load_stage
from kimi_mlx.testing.cluster import reference_checkpoint

PROMPTS = [list(range(10, 30)), list(range(40, 47)), list(range(5, 18))]
STEPS = 6


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    from kimi_mlx.cluster.fingerprint import fingerprint

    path = reference_checkpoint(tmp_path_factory.mktemp("rows"))
    fp = fingerprint(path)
    a = load_stage(path, StageSpec(fp, 0, 3, 0, 2, "float32", "float32"))[0]
    b = load_stage(path, StageSpec(fp, 3, 6, 1, 2, "float32", "float32"))[0]
    return a, b


def _prefill(a, b, ids, name, sampling):
    sa, sb = a.new_session(name, "h", sampling), b.new_session(name, "h", sampling)
    hidden = a.run(sa, 0, 0, mx.array([ids]), True).hidden
    return sa, sb, b.run(sb, 0, 0, hidden, True).token


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temp=1.0, seed=7)],
                         ids=["greedy", "seeded sampling"])
def test_rows_decoded_together_equal_each_alone(stages, sampling):
    a, b = stages
    alone = []
    for k, ids in enumerate(PROMPTS):
        sa, sb, t = _prefill(a, b, ids, f"s{k}", sampling)
        out = [t]
        for i in range(STEPS):
            hidden = a.run(sa, i + 1, len(ids) + i, mx.array([[out[-1]]]), True).hidden
            out.append(b.run(sb, i + 1, len(ids) + i, hidden, True).token)
        alone.append(out)
    sessions = [_prefill(a, b, ids, f"r{k}", sampling) for k, ids in enumerate(PROMPTS)]
    together = [[t] for _, _, t in sessions]
    for i in range(STEPS):
        seqs, offsets = [i + 1] * len(PROMPTS), [len(ids) + i for ids in PROMPTS]
        x = mx.array([[o[-1]] for o in together], dtype=mx.int32)
        hidden = a.run_rows([s[0] for s in sessions], seqs, offsets, x)[0].hidden
        assert hidden.shape[1:] == (len(PROMPTS), 1, a.args.hidden_size)
        for o, r in zip(together, b.run_rows([s[1] for s in sessions], seqs, offsets, hidden)):
            o.append(r.token)
    assert together == alone
    assert len({tuple(o) for o in alone}) > 1  # different sessions: the check can fail


def test_a_bad_batch_is_refused_and_changes_nothing(stages):
    a, b = stages
    s1, _, _ = _prefill(a, b, PROMPTS[0], "x1", Sampling())
    s2, _, _ = _prefill(a, b, PROMPTS[1], "x2", Sampling())
    x = mx.array([[1], [2]], dtype=mx.int32)
    with pytest.raises(Refused, match="expected 1"):  # wrong sequence number for s2
        a.run_rows([s1, s2], [1, 5], [len(PROMPTS[0]), len(PROMPTS[1])], x)
    with pytest.raises(Refused, match="twice"):
        a.run_rows([s1, s1], [1, 1], [len(PROMPTS[0])] * 2, x)
    assert (s1.next_seq, s1.offset, s2.next_seq) == (1, len(PROMPTS[0]), 1)

"""`--draft ngram` through the pipeline: three stage processes on loopback serving the
shipped micro checkpoint, prompt lookup on the head.

References: mlx-lm's `generate_step` in one process (greedy tokens) and `kimi-mlx
generate` (the launcher's output).
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.cluster.head.speculative import speculative_pipeline_step
from kimi_mlx.speculative.loop import SpecStats
from kimi_mlx.speculative.ngram import NgramDraft

from test_cluster_speculative import _run, _text, _wait_no_sessions


@pytest.fixture(scope="module")
def cluster(micro_pipeline):
    """The session's 3 loopback stages (tests/fixtures/shared.py): this module only reads them."""
    return micro_pipeline


@pytest.fixture(scope="module")
def loaded(cluster):
    t, stages = cluster.load_transport()
    try:
        yield t, stages
    finally:
        t.shutdown()


@pytest.fixture(scope="module")
def micro(cluster):
    """(one-process target, real-code prompts: one short, one past index_topk (64))."""
    from kimi_mlx.checkpoint.loader import load_for_generation

    model, _, tok, _ = load_for_generation(str(cluster.ckpt))
    code = (cluster.ckpt / "heldout" / "code.txt").read_text()
    prompts = [tok.encode(code[:60]), tok.encode(code[1000:1400])]
    assert len(prompts[0]) < 64 < len(prompts[1])
    return model, prompts


def test_greedy_ngram_through_three_stages_equals_plain_greedy(cluster, loaded, micro):
    t, stages = loaded
    model, prompts = micro
    assert len(stages) == 3
    n = 32
    stats = SpecStats()
    for prompt in prompts:
        want = [tok for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
        for k in (2, 4):
            got = [tok for tok, _, _ in speculative_pipeline_step(
                Pipeline(t, prefill_chunk=32), prompt, NgramDraft(), model.args,
                num_draft_tokens=k, max_tokens=n, stats=stats)]
            assert got == want, (len(prompt), k)
    assert 0 < stats.accepted < stats.drafted and stats.plain > 0  # every path ran
    assert _wait_no_sessions(cluster, [0, 1, 2]) == [0, 0, 0]


@pytest.mark.e2e  # a whole launch + generate run; the in-process greedy run above stays in make test
def test_launch_with_ngram_prints_what_generate_prints(cluster):
    flags = ["--model", str(cluster.ckpt), "--prompt", "def f(x):\n    return x\n\ndef f(x):",
             "--max-tokens", "24", "--ignore-chat-template", "--temp", "0"]
    ref = _run(["generate"] + flags)
    nodes = ",".join(p.address for p in cluster.procs)
    launch = _run(["cluster", "launch", "--nodes", nodes, "--secret-file",
                   str(cluster.secret_file), "--draft", "ngram", "--num-draft-tokens", "4"]
                  + flags)
    assert launch.returncode == 0, launch.stderr
    assert ref.returncode == 0, ref.stderr
    assert _text(launch.stdout) == _text(ref.stdout)
    assert "Speculative:" in launch.stdout
    assert _wait_no_sessions(cluster, [0, 1, 2]) == [0, 0, 0]

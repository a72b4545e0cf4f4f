"""Block drafters (DFlash / DSpark) through the pipeline (issue 36 part 2): the stages that
own the drafter's `target_layer_ids` send those hidden states to the head with their
answer (`node.capture`, `Activation.capture_layers` / `captured`, `Event.hidden`), and
`head.speculative.PipelineTarget.forward_capture` hands them to the unchanged block loop.

References are independent of the code under test: one process's
`TextModel.run_layers(capture=...)` (the hidden states), mlx-lm's `generate_step` in one
process (greedy tokens), and one process's block loop (accepted drafts per step). Three
stage processes on loopback, on free ports, with hard timeouts.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.cluster.head.speculative import PipelineTarget, speculative_pipeline_step
from kimi_mlx.cluster.head.transport import TokenResult
from kimi_mlx.cluster.node.runner import Refused, StageSpec, load_stage
from kimi_mlx.model.attn_res import Banks
from kimi_mlx.sampling import Sampling
from kimi_mlx.speculative.block_loop import block_generate_step
from kimi_mlx.speculative.factory import ONE_PROCESS, PIPELINE, build_speculation
from kimi_mlx.speculative.loop import SpecStats
from kimi_mlx.speculative.settings import DraftSettings
from kimi_mlx.testing.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
DSPARK = ROOT / "kimi_mlx" / "assets" / "micro-dspark"
HARD_TIMEOUT = 150
# real code, so that the trained drafter is accepted; past micro's index_topk (64)
CODE = ('class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self):\n'
        '        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n'
        '    def pop(self):\n        return self.items.pop(0)\n\n\nclass Stack:\n'
        '    """A simple LIFO stack."""\n\n    def __init__(self')
PROSE = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this "
         "software and associated documentation files (the Software), to deal in the Software "
         "without restriction, including without limitation the rights to use, copy, modify, "
         "merge, publish, distribute, sublicense, and/or sell copies of the Software, and to")


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
    """(one-process target, its tokenizer)."""
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    model, _, _ = load_model(str(cluster.ckpt), verbose=False)
    return model, KimiTokenizer.from_pretrained(str(cluster.ckpt))


# -------------------------------------------------------- stage capture vs one process


@pytest.fixture(scope="module")
def runners(cluster, loaded):
    """The three layer ranges as StageRunners in this process (float32 in and out)."""
    _, stages = loaded
    return [load_stage(cluster.ckpt, StageSpec(cluster.fp, s.start, s.end, i, 3, "float32",
                                                "float32"))[0]
            for i, s in enumerate(stages)]


def _through(runners, sessions, seq, offset, tokens, ids, verify=False):
    """One capturing message through every stage, passing `captured` on as the service
    does; returns the last stage's Output."""
    x, prior = mx.array([tokens], mx.int32), None
    for r, s in zip(runners, sessions):
        out = r.run(s, seq, offset, x, False, verify, capture=(ids, prior))
        x, prior = out.hidden, out.captured
    return out


def _one_process(model, prefix, tokens, ids):
    """run_layers(capture=...) of the whole model on `tokens` after `prefix` (its caches
    filled by a plain forward): {layer id: [L, D]}."""
    cache = model.make_cache()
    if prefix:
        model(mx.array([prefix]), cache=cache)
    text = model.text
    cap = {i: None for i in ids}
    text.run_layers(text.embed(mx.array([tokens])), Banks(model.args.rms_norm_eps), cache,
                    capture=cap)
    return {i: cap[i][0] for i in ids}


@pytest.mark.parametrize("ids", [[0, 1, 2, 3, 4, 5], [1, 4]])
def test_stage_captures_equal_one_process_run_layers(runners, micro, ids):
    """A 70-token prefill chunk (past index_topk) and a 5-token verify chunk: the rows the
    last stage returns are one process's `run_layers` captures, layer by layer; with
    [1, 4] the middle stage owns none and passes stage 0's row on."""
    model = micro[0]
    prompt = [(37 * i + 11) % 4000 + 100 for i in range(70)]
    verify = [prompt[-1], 812, 1303, 77, 2900]
    sessions = [r.new_session(f"cap{len(ids)}", "head", Sampling()) for r in runners]
    pre = _through(runners, sessions, 0, 0, prompt[:-1], ids)
    ver = _through(runners, sessions, 1, len(prompt) - 1, verify, ids, verify=True)
    assert ver.logits is not None and pre.logits is None and pre.token is None
    D = model.args.hidden_size
    for out, prefix, toks in ((pre, [], prompt[:-1]), (ver, prompt[:-1], verify)):
        assert out.captured.shape == (len(ids), len(toks), D)
        assert out.captured.dtype == mx.float32
        want = _one_process(model, prefix, toks, ids)
        for j, i in enumerate(ids):
            got, ref = out.captured[j], want[i].astype(mx.float32)
            scale = float(mx.abs(ref).max())
            assert float(mx.abs(got - ref).max()) <= 1e-4 * scale, (i, scale)
    # the comparison can fail: another layer's rows are far off
    assert float(mx.abs(ver.captured[0] - want[ids[-1]]).max()) > 1e-2


def test_no_capture_asked_nothing_captured(runners):
    s = [r.new_session("plain", "head", Sampling()) for r in runners]
    x = mx.array([[5, 6, 7]], mx.int32)
    for r, sess in zip(runners, s):
        out = r.run(sess, 0, 0, x, False)
        assert out.captured is None
        x = out.hidden


# ----------------------------------------------------------------- bad capture messages


def test_bad_captured_rows_between_stages_are_refused_naming_the_stage(runners):
    """Stage 1 given rows of the wrong shape (or none, or too many) refuses the chunk,
    naming stage 0 as their sender and the shape wanted, before any compute; as the
    service checks them off the wire (`ForwardRPC._captured`)."""
    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.net.wire import to_tensor
    from kimi_mlx.cluster.node.forward import ForwardRPC

    r0, r1 = runners[0], runners[1]
    D = r1.args.hidden_size
    ids = [0, 1, 2, 3]  # stage 0 owns [0, 2): two rows arrive at stage 1
    s0, s1 = r0.new_session("bad", "head", Sampling()), r1.new_session("bad", "head", Sampling())
    x = mx.array([[5, 6, 7]], mx.int32)
    out = r0.run(s0, 0, 0, x, False, capture=(ids, None))
    assert out.captured.shape == (2, 3, D)
    with pytest.raises(Refused, match=r"before stage 1: shape \[1, 3, %d\], expected "
                                      r"\[2, 3, %d\]" % (D, D)):
        r1.run(s1, 0, 0, out.hidden, False, capture=(ids, out.captured[:1]))
    with pytest.raises(Refused, match="strictly ascending"):
        r1.run(s1, 0, 0, out.hidden, False, capture=([3, 1], out.captured))
    assert s1.offset == 0 and s1.next_seq == 0  # refused before anything ran

    msg = pb.Activation(session="bad", seq=0, offset=0, length=3, capture_layers=ids)
    to_tensor(out.captured[:, :2], out=msg.captured)
    with pytest.raises(Refused, match=r"captured hidden states from stage 0: shape "
                                      r"\[2, 2, %d\], expected \[2, 3, %d\]" % (D, D)):
        ForwardRPC._captured(msg, r1)
    msg.ClearField("captured")
    with pytest.raises(Refused, match="from stage 0 are missing"):
        ForwardRPC._captured(msg, r1)
    to_tensor(out.captured.astype(mx.float16), out=msg.captured)
    with pytest.raises(Refused, match="dtype float16, expected float32"):
        ForwardRPC._captured(msg, r1)
    msg = pb.Activation(session="bad", seq=0, offset=0, length=3, capture_layers=[2, 3])
    to_tensor(out.captured, out=msg.captured)
    with pytest.raises(Refused, match="no capture layer lies before stage 1"):
        ForwardRPC._captured(msg, r1)


class _Answers:
    """A transport whose last stage answers every capturing message with `hidden` rows of
    a given shape (stage 2, described as the real transport does)."""

    stages = [None, None, None]

    def __init__(self, shape):
        self.shape, self.sent = shape, []

    def describe(self, i):
        return f"stage {i} (node n{i} at 127.0.0.1:1, layers [4, 6))"

    def send(self, session, seq, offset, tokens, sample, verify=False, keep=None,
             capture=None):
        self.sent.append(dict(seq=seq, n=len(tokens), verify=verify, capture=capture))

    def receive(self, session, timeout=None):
        m = self.sent[-1]
        return TokenResult(session, m["seq"], 0, hidden=mx.zeros(self.shape), stage=2)


def test_a_misshapen_capture_reply_names_the_stage(micro):
    """The head checks the rows the last stage returns against [layers, T, hidden] and
    names that stage; a right-shaped reply is reordered to the drafter's layer order."""
    args = micro[0].args
    D = args.hidden_size
    t = _Answers((2, 3, D + 1))
    target = PipelineTarget(t, "s", args, n_prefill=10, prefill_chunk=8)
    with pytest.raises(ValueError, match=r"stage 2 \(node n2 at 127\.0\.0\.1:1, layers \[4, 6\)\)"
                                         r" answered message seq 0 with captured hidden states "
                                         r"\[2, 3, %d\], expected \[2, 3, %d\]" % (D + 1, D)):
        target.forward_capture(mx.array([[1, 2, 3]]), [4, 1])
    assert t.sent[0]["capture"] == [1, 4]  # ascending on the wire

    class Ordered(_Answers):
        def receive(self, session, timeout=None):
            m = self.sent[-1]
            rows = mx.stack([mx.full((m["n"], D), float(i)) for i in m["capture"]])
            return TokenResult(session, m["seq"], 0, hidden=rows, stage=2)

    target = PipelineTarget(Ordered(None), "s", args, n_prefill=10, prefill_chunk=8)
    logits, hid = target.forward_capture(mx.array([[1, 2, 3]]), [4, 1])
    assert logits is None and hid.shape == (1, 3, 2 * D)
    assert float(hid[0, 0, 0]) == 4.0 and float(hid[0, 0, D]) == 1.0  # the drafter's order
    with pytest.raises(ValueError, match="repeat a layer"):
        target.forward_capture(mx.array([[4]]), [1, 1])


# ------------------------------------------------------------- through three stages


def _plain(model, prompt, n):
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n),
                                        range(n))]


def test_greedy_block_draft_through_three_stages_equals_plain(cluster, loaded, micro):
    """The shipped micro-dspark on the head, micro's 6 layers on 3 loopback stages:
    greedy output equals one process's plain greedy output on prompts past index_topk,
    drafts are accepted, and the accepted drafts per verify step are one process's
    block loop's (the same hidden states reach the drafter)."""
    t, stages = loaded
    model, tok = micro
    assert len(stages) == 3 and model.args.index_topk == 64
    n = 24
    for text, k in ((CODE, 4), (PROSE, 3)):
        prompt = tok.encode(text)
        assert len(prompt) > 64, len(prompt)
        spec = build_speculation(DraftSettings(model=str(DSPARK), num_draft_tokens=k),
                                 where=PIPELINE, target_name=str(cluster.ckpt))
        stats = SpecStats()
        got = [tok_ for tok_, _, _ in speculative_pipeline_step(
            Pipeline(t, prefill_chunk=32), prompt, spec.draft, model.args,
            num_draft_tokens=k, max_tokens=n, stats=stats)]
        assert got == _plain(model, prompt, n), text[:20]
        assert stats.accepted > 0 and stats.steps < n
        one = SpecStats()
        ref_draft = build_speculation(DraftSettings(model=str(DSPARK)), where=ONE_PROCESS,
                                      model=model).draft  # bound to the loaded target
        ref = [x for x, _, _ in block_generate_step(prompt, model, ref_draft,
                                                    num_draft_tokens=k, max_tokens=n,
                                                    prefill_step_size=32, stats=one)]
        assert ref == got
        print(f"micro-dspark k={k}, {len(prompt)}-token prompt: 3 stages {stats.steps} verify "
              f"steps, {stats.mean_accepted:.2f} accepted per step; one process "
              f"{one.steps} steps, {one.mean_accepted:.2f}")
        assert stats.per_step == one.per_step
    end = time.monotonic() + 5
    while any(cluster.sessions(i) for i in range(3)) and time.monotonic() < end:
        time.sleep(0.05)
    assert [cluster.sessions(i) for i in range(3)] == [0, 0, 0]  # every session freed


def _run(cmd):
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main"] + cmd,
                          capture_output=True, text=True, timeout=HARD_TIMEOUT)


@pytest.mark.e2e  # a whole launch run; the cluster server with the drafter stays in make test
def test_launch_with_a_block_drafter_prints_the_plain_text(cluster):
    """`cluster launch --draft-model micro-dspark` over the 3 stages: the text of plain
    `kimi-mlx generate`, with drafts accepted (its Speculative line)."""
    flags = ["--model", str(cluster.ckpt), "--prompt", CODE, "--max-tokens", "24",
             "--ignore-chat-template", "--temp", "0"]
    ref = _run(["generate"] + flags)
    nodes = ",".join(p.address for p in cluster.procs)
    launch = _run(["cluster", "launch", "--nodes", nodes, "--secret-file",
                   str(cluster.secret_file), "--draft-model", str(DSPARK),
                   "--num-draft-tokens", "4", "--verbose", "true"] + flags)
    assert ref.returncode == 0, ref.stderr
    assert launch.returncode == 0, launch.stderr
    assert launch.stdout.split("==========")[1] == ref.stdout.split("==========")[1]
    m = re.search(r"Speculative: (\d+) verify steps .*?([\d.]+) accepted per step", launch.stdout)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, launch.stdout[-800:]


def test_cluster_server_with_a_block_drafter_equals_plain(cluster, micro):
    """`cluster server --draft-model micro-dspark` (pipeline): greedy completions equal one
    process's plain greedy text, and /metrics counts accepted drafts."""
    import httpx

    from kimi_mlx.testing.cluster import ServerProc

    model, tok = micro
    server = ServerProc(cluster, free_ports(1)[0], "--draft-model", str(DSPARK),
                        "--num-draft-tokens", "4")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=HARD_TIMEOUT,
                       json={"model": "micro", "prompt": CODE, "max_tokens": 16,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(_plain(model, tok.encode(CODE), 16))
        m = httpx.get(server.url + "/metrics", timeout=10).text
        accepted = sum(float(l.split()[-1]) for l in m.splitlines()
                       if l.startswith("kimi_mlx_speculative_accepted_tokens_total "))
        assert accepted > 0
    finally:
        server.stop()


def test_bench_spec_loads_the_block_draft_for_the_stages(cluster, loaded, micro):
    """`bench spec --stages`: the block draft without a target (the head holds no layers)
    binds to the checkpoint's embedding and head, and its rows run through the stages."""
    from kimi_mlx.bench.spec import load_drafts
    from kimi_mlx.cluster.bench.spec import bench_rows

    t, _ = loaded
    model, tok = micro
    (name, draft), = load_drafts(["block"], None, None, str(cluster.ckpt)).items()
    assert name.startswith("block ")
    rows = bench_rows(Pipeline(t), draft, model.args, [tok.encode(CODE)], tokens=8, ks=[2],
                      repeats=1)
    assert rows[0]["k"] == 2 and rows[0]["spec_tps"] > 0 and rows[0]["mean_accepted"] > 0

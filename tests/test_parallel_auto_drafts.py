"""`--parallel auto` decides with drafts when the server drafts
(placement/parallel_choice.py `choose_parallel`, verify_cost.py `choose_with_drafts`,
commands/plan.py `--drafts`, cluster/launch.py `recommended`).

The case on the shipped config where drafts change the answer: K3.1 with a 4-bit trunk on
4x512GB over the TCP ring (the latency `cluster launch/server --parallel auto` plans
with), one sequence at 131,072 tokens. Plain, the pipeline is ahead (13.3 tok/s against
the group's 12.7); with DSpark's acceptance the group's 187 collectives per step are paid
once for every accepted token of a step, and its best k beats the pipeline's (32.6 at
k = 7 against 22.1 at k = 4). Over JACCL the group wins either way. The figures each
choice reports are the best rows of the speculative tables computed here directly
(`verify_cost.k_table` / `tensor_k_table`, whose bytes tests/test_verify_cost*.py check).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kimi_mlx.placement import layer_bytes as lb
from kimi_mlx.placement.expert_union import load_curve
from kimi_mlx.placement.layer_bytes import BuildSpec, model_bytes
from kimi_mlx.placement.parallel_choice import choose_parallel
from kimi_mlx.placement.planner import GB, Node, StagePlanner, parse_macs
from kimi_mlx.placement.tensor_parallel import (JACCL_LATENCY_S, TCP_LATENCY_S, tensor_fits,
                                               tensor_plan_for, tensors_of)
from kimi_mlx.placement.verify_cost import (KRow, choose_with_drafts, k_table,
                                            parse_acceptance, tensor_k_table)

K31 = "moonshotai/Kimi-K3.1-Pro"
CTX = 131_072
Q4 = BuildSpec(None, 4, 64, None, 64)
MAX_K = 8


@pytest.fixture(autouse=True)
def no_hf_cache(monkeypatch):
    monkeypatch.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)


@pytest.fixture(scope="module")
def tables():
    """{latency: (pipeline table, tensor table)} at one row, k up to MAX_K, computed
    directly from the planner and the verify-cost tables."""
    mp = pytest.MonkeyPatch()
    mp.setattr(lb, "_hf_cached_file", lambda model_id, filename: None)
    nodes = parse_macs("4x512GB", "m3-ultra", None)
    planner = StagePlanner()
    mb = model_bytes(K31, Q4)
    plan = planner.plan(mb, nodes, CTX, 1)
    targs, tensors = tensors_of(K31, Q4)
    tp = tensor_plan_for(tensors, targs, [n.bandwidth_bytes_per_s for n in nodes], CTX)
    assert tensor_fits(tp, nodes, 1, planner._headroom)
    acc, _ = parse_acceptance("3.45")
    ks, curve = range(1, MAX_K + 1), load_curve()
    out = {lat: (k_table(plan, mb, acc, planner.hop_latency_s, ks, 0.0, curve),
                 tensor_k_table(tp, tensors, targs, CTX, acc, lat, ks, 0.0, curve))
           for lat in (TCP_LATENCY_S, JACCL_LATENCY_S)}
    mp.undo()
    return nodes, plan, tp, out


def _best(table):
    plain, rows = table
    return max([plain] + rows, key=lambda r: r.tokens_per_s)


def test_drafts_turn_the_tcp_ring_choice_to_the_tensor_group(tables):
    nodes, plan, tp, by_latency = tables
    pipe, group = by_latency[TCP_LATENCY_S]
    # the premise, from the tables: plain the pipeline, with drafts the group
    assert pipe[0].tokens_per_s > group[0].tokens_per_s
    assert _best(group).tokens_per_s > _best(pipe).tokens_per_s
    plain = choose_parallel(K31, nodes, CTX, 1, TCP_LATENCY_S, build=Q4)
    assert plain.mode == "pipeline" and plain.tensor_fits
    assert f"vs {plan.tokens_per_s * 1:.1f} for the pipeline" in plain.why
    drafted = choose_parallel(K31, nodes, CTX, 1, TCP_LATENCY_S, drafts=True, build=Q4,
                              max_draft_tokens=MAX_K)
    assert drafted.mode == "tensor"
    t, p = _best(group), _best(pipe)
    assert (f"{t.tokens_per_s:.1f} tok/s for the tensor group at k = {t.k} (plain "
            f"{group[0].tokens_per_s:.1f}) vs {p.tokens_per_s:.1f} for the pipeline at "
            f"k = {p.k} (plain {pipe[0].tokens_per_s:.1f})") in drafted.why
    assert drafted.why.endswith("; without drafts it would be the pipeline")


def test_over_jaccl_drafts_keep_the_tensor_group(tables):
    nodes, _, _, by_latency = tables
    pipe, group = by_latency[JACCL_LATENCY_S]
    assert group[0].tokens_per_s > pipe[0].tokens_per_s
    assert _best(group).tokens_per_s > _best(pipe).tokens_per_s
    for drafts in (False, True):
        c = choose_parallel(K31, nodes, CTX, 1, JACCL_LATENCY_S, drafts=drafts, build=Q4,
                            max_draft_tokens=MAX_K)
        assert c.mode == "tensor"
        assert "without drafts" not in c.why
        if drafts:
            assert f"{_best(group).tokens_per_s:.1f} tok/s for the tensor group" in c.why


def _row(k, tok_s):
    return KRow(k, 1.0, 1.0, 1.0, 1.0, tok_s, 1.0)


def test_choose_with_drafts_by_hand():
    pipe = (_row(0, 10.0), [_row(1, 14.0), _row(2, 13.0)])
    group = (_row(0, 9.0), [_row(1, 12.0), _row(2, 15.0)])
    assert choose_with_drafts(pipe, group, True, 1)[0] == "tensor"
    assert "without drafts it would be the pipeline" in choose_with_drafts(pipe, group, True, 1)[1]
    # drafts that buy the pipeline more turn a plain tensor choice back
    assert choose_with_drafts((_row(0, 9.5), [_row(3, 16.0)]), group, True, 4) == (
        "pipeline", "with drafts at --max-concurrency 4 the planner predicts 15.0 tok/s for "
        "the tensor group at k = 2 (plain 9.0) vs 16.0 for the pipeline at k = 3 (plain 9.5)")
    # a tie keeps the pipeline; a group that does not fit or cannot form is never chosen
    assert choose_with_drafts((_row(0, 1.0), [_row(1, 15.0)]), group, True, 1)[0] == "pipeline"
    assert choose_with_drafts(pipe, group, False, 1) == (
        "pipeline", "a tensor group does not fit in the Macs' memory")
    assert choose_with_drafts(pipe, None, False, 1)[0] == "pipeline"
    assert choose_with_drafts(None, group, True, 1)[0] == "tensor"


def test_plan_drafts_flag_prints_the_choice_with_drafts(capsys):
    from kimi_mlx.commands.main import main

    argv = ["plan", "--model", K31, "--macs", "4x512GB", "--q-bits", "4",
            "--max-draft-tokens", str(MAX_K)]
    assert main(argv + ["--max-concurrency", "1"]) == 0
    out = capsys.readouterr().out
    assert "cluster server --parallel auto over TCP ring: pipeline (" in out
    assert "--parallel auto with drafts" not in out
    assert main(argv + ["--drafts"]) == 0
    out = capsys.readouterr().out
    lines = {l.split(":")[0]: l for l in out.splitlines()
             if l.startswith("cluster server --parallel auto")}
    assert lines["cluster server --parallel auto with drafts over TCP ring"].endswith(
        "; without drafts it would be the pipeline)")
    assert ": tensor (with drafts at --max-concurrency 1" in \
        lines["cluster server --parallel auto with drafts over TCP ring"]
    assert ": tensor (" in lines["cluster server --parallel auto with drafts over JACCL"]


def test_cluster_recommended_passes_drafts_and_the_cache_format(monkeypatch, capsys):
    """`cluster launch/server --parallel auto` (`recommended`): the group is this head and
    the nodes, over the TCP ring, and the answer is `choose_parallel`'s with the server's
    drafts and --kv-bits (micro on one 8 GB node: a 2-rank group)."""
    from pathlib import Path

    import kimi_mlx.cluster.net.control as control
    from kimi_mlx.cluster.launch import recommended

    micro = str(Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro")
    node = Node("n1", 8 * GB, 800 * GB)
    monkeypatch.setattr(control, "ControlClient",
                        lambda *a, **k: SimpleNamespace(shutdown=lambda: None))
    finder = SimpleNamespace(secret=b"", settings=SimpleNamespace(tls_secret_path=None),
                             model_dir=Path(micro), checked=None,
                             accepted=lambda t: [(SimpleNamespace(planner_node=lambda: node), None)])
    for drafts, kv in ((False, None), (True, None), (True, 8)):
        mode = recommended(finder, 4096, 2, drafts=drafts, kv_bits=kv, kv_group_size=32)
        err = capsys.readouterr().err
        want = choose_parallel(micro, [node], 4096, 2, TCP_LATENCY_S, drafts=drafts,
                               tensor_nodes=[node, node], kv_bits=kv, kv_group_size=32)
        assert mode == want.mode
        assert f"--parallel auto chose {want.mode}: {want.why} (1 node(s);" in err
        assert ("with drafts at --max-concurrency 2" in err) == drafts
    # micro's 32 index-key values take no group of 64: counted in bf16, with a warning
    assert recommended(finder, 4096, 2, kv_bits=8, kv_group_size=64) == \
        recommended(finder, 4096, 2)

"""Domain-balanced saliency and "what the build lost" (issue 38 parts 2-3) on micro-moe."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

import kimi_mlx
from kimi_mlx.prune.calib import CalibError, CalibSet, load_calibration
from kimi_mlx.prune.observe import LayerStats
from kimi_mlx.prune.saliency import floor_size, select

MICRO_MOE = __import__("pathlib").Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro-moe"
SEQ = 64


def _tok():
    from kimi_mlx.text.tokenizer import KimiTokenizer

    return KimiTokenizer.from_pretrained(MICRO_MOE)


def _stats(layer, count, gate_norm):
    count = np.asarray(count)
    st = LayerStats(layer, len(count), 2)
    st.count[:] = count
    st.softmax_gate_norm_sum[:] = gate_norm
    st.tokens = int(count.sum())
    return st


# ---- calibration domains ------------------------------------------------------------

def test_calibration_domains_from_subfolder_file_and_record_field(tmp_path):
    (tmp_path / "zh").mkdir()
    (tmp_path / "zh" / "a.txt").write_text(" ".join(f"ni{i} hao" for i in range(300)))
    (tmp_path / "code.txt").write_text("".join(f"x{i} = f({i})\n" for i in range(300)))
    (tmp_path / "mixed.jsonl").write_text(
        json.dumps({"input_ids": list(range(1, 200)), "domain": "maths"}) + "\n"
        + json.dumps({"input_ids": list(range(5, 105))}) + "\n")
    cs = load_calibration([tmp_path], _tok, seq_len=32, max_tokens=None, heldout_tokens=40)
    assert set(cs.domain_names) == {"zh", "code", "maths", "mixed"}
    # held-out sequences are set aside per domain, never calibrated on
    held = cs.heldout_by_domain()
    for d, seqs in held.items():
        assert 0 < sum(map(len, seqs)) <= 40 and d in set(cs.domains)
        for s in seqs:
            assert s not in [c for c, dd in zip(cs.sequences, cs.domains) if dd == d]
    # no budget: nothing is left over, so each domain gives up at most a tenth
    for d, seqs in held.items():
        mine = sum(len(c) for c, dd in zip(cs.sequences, cs.domains) if dd == d)
        assert sum(map(len, seqs)) <= (mine + sum(map(len, seqs))) // 10
    # a budget is shared out evenly: round-robin over the domains
    small = load_calibration([tmp_path], _tok, seq_len=32, max_tokens=4 * 32)
    assert set(small.domains) == {"zh", "code", "maths", "mixed"} and small.num_tokens == 128
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2, 3], "domain": 7}) + "\n")
    with pytest.raises(CalibError, match=r"bad.jsonl:1: 'domain' must be a non-empty string"):
        load_calibration([bad], _tok, seq_len=32)


# ---- balanced selection vs NumPy ----------------------------------------------------

def _domain_fixture(rng, e=16, layers=(1, 2)):
    """Pooled + per-domain stats of two domains, 'big' with 20x the tokens of 'small'."""
    per = {"big": {}, "small": {}}
    for l in layers:
        for d, scale in (("big", 20.0), ("small", 1.0)):
            count = rng.integers(1, 50, e) * scale
            per[d][l] = _stats(l, count, count * rng.uniform(0.5, 2.0, e))
    pooled = {l: _stats(l, per["big"][l].count + per["small"][l].count,
                        per["big"][l].softmax_gate_norm_sum + per["small"][l].softmax_gate_norm_sum)
              for l in layers}
    return pooled, per


@pytest.mark.parametrize("seed", range(5))
def test_balanced_scores_match_numpy(seed):
    rng = np.random.default_rng(seed)
    pooled, per = _domain_fixture(rng)
    n = 6
    for balance in ("max", "mean", "floor"):
        sel = select(pooled, "reap-sum", n, balance=balance, domain_stats=per)
        assert sel.balance == balance
        for l in pooled:
            raw = {d: per[d][l].softmax_gate_norm_sum for d in per}
            for d, v in raw.items():  # what the report shows: score / layer maximum
                np.testing.assert_allclose(sel.domain_scores[d][l], v / v.max())
            if balance == "max":
                want = np.max([v / v.max() for v in raw.values()], axis=0)
            elif balance == "mean":
                want = np.mean([v / v.sum() for v in raw.values()], axis=0)
            else:
                want = pooled[l].softmax_gate_norm_sum
            np.testing.assert_allclose(sel.scores[l], want)
            if balance == "floor":
                f = floor_size(n, 2)
                first = set()
                for v in raw.values():
                    first |= set(np.argsort(-v, kind="stable")[:f].tolist())
                rest = [j for j in np.argsort(-want, kind="stable") if j not in first]
                expect = sorted(first | set(rest[: n - len(first)]))
            else:
                expect = sorted(np.argsort(-want, kind="stable")[:n].tolist())
            assert sel.kept[l] == expect, (balance, l)


@pytest.mark.parametrize("seed", range(8))
def test_balance_keeps_every_domains_top_expert(seed):
    """The balance property: with max and floor every domain's most salient expert is
    kept in every layer; pooling (none) lets the big domain crowd it out in some draws."""
    rng = np.random.default_rng(100 + seed)
    pooled, per = _domain_fixture(rng)
    n = 3
    for balance in ("max", "floor"):
        sel = select(pooled, "reap-sum", n, balance=balance, domain_stats=per)
        for l in pooled:
            for d in per:
                top = int(np.argmax(per[d][l].softmax_gate_norm_sum))
                assert top in sel.kept[l], (balance, d, l)


def test_pooling_drops_a_small_domains_top_expert():
    """A hand case where `none` loses the small domain's best expert and `max` keeps it."""
    big = _stats(1, [100, 90, 80, 1], [100, 90, 80, 0.1])
    small = _stats(1, [1, 1, 1, 5], [0.1, 0.1, 0.1, 5.0])
    pooled = {1: _stats(1, big.count + small.count,
                        big.softmax_gate_norm_sum + small.softmax_gate_norm_sum)}
    per = {"big": {1: big}, "small": {1: small}}
    assert 3 not in select(pooled, "reap-sum", 2, balance="none", domain_stats=per).kept[1]
    assert 3 in select(pooled, "reap-sum", 2, balance="max", domain_stats=per).kept[1]
    # the default (no balance, chosen by make bench-domains) pools
    assert 3 not in select(pooled, "reap-sum", 2, domain_stats=per).kept[1]
    # one domain: every balance is the pooled score
    one = select(pooled, "reap-sum", 2, balance="max", domain_stats={"big": {1: big}})
    assert one.balance == "none" and 3 not in one.kept[1]


# ---- observe: per-domain statistics vs separate passes --------------------------------

def _ids(text, n, start=0):
    ids = _tok().encode(text)
    return ids[start:start + n]


@pytest.fixture(scope="module")
def micro_seqs():
    code = (MICRO_MOE / "calib" / "code.txt").read_text()
    data = (MICRO_MOE / "calib" / "data.txt").read_text()
    return {"code": [_ids(code, SEQ, 0), _ids(code, SEQ, 500)],
            "data": [_ids(data, SEQ, 0), _ids(data, SEQ, 700)]}


def test_domain_stats_equal_a_pass_over_that_domain_alone(micro_seqs):
    from kimi_mlx.prune.observe import observe

    seqs = [s for d in ("code", "data") for s in micro_seqs[d]]
    doms = ["code", "code", "data", "data"]
    both = observe(MICRO_MOE, CalibSet(seqs, doms, [], 4, seq_len=SEQ, domains=doms),
                   chunk=SEQ, progress=False)
    assert set(both.domain_stats) == {"code", "data"}
    for d in ("code", "data"):
        alone = observe(MICRO_MOE, CalibSet(micro_seqs[d], [d, d], [], 2, seq_len=SEQ),
                        chunk=SEQ, progress=False)
        for l, st in alone.stats.items():
            got = both.domain_stats[d][l]
            assert got.tokens == st.tokens == 2 * SEQ
            np.testing.assert_array_equal(got.count, st.count)
            np.testing.assert_allclose(got.softmax_gate_norm_sum, st.softmax_gate_norm_sum,
                                       rtol=1e-5)
            np.testing.assert_allclose(got.max_abs, st.max_abs, rtol=1e-5)
    for l, st in both.stats.items():
        np.testing.assert_array_equal(st.count, sum(both.domain_stats[d][l].count
                                                    for d in ("code", "data")))


# ---- the card's table and eval --compare vs an independent evaluation ----------------

@pytest.fixture(scope="module")
def build(tmp_path_factory, micro_seqs):
    from kimi_mlx.prune.pipeline import prune

    tmp = tmp_path_factory.mktemp("domains")
    rows = [{"input_ids": s, "domain": d} for d, ss in micro_seqs.items() for s in ss]
    for d, at in (("code", 2000), ("data", 2500)):  # left over by the budget: held out
        text = (MICRO_MOE / "calib" / f"{d}.txt").read_text()
        rows.append({"input_ids": _ids(text, SEQ, at), "domain": d})
    f = tmp / "calib.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calib = load_calibration([f], _tok, seq_len=SEQ, max_tokens=4 * SEQ, heldout_tokens=SEQ)
    assert {d: len(v) for d, v in calib.heldout_by_domain().items()} == {"code": 1, "data": 1}
    res = prune(MICRO_MOE, tmp / "build", calib, "reap-sum", 8, progress=False,
                balance="max", chunk=SEQ, log=lambda s: None)
    return res, calib


def _independent_ppl(ckpt, seqs):
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.generation.evaluate import perplexity

    model, _, _ = load_model(ckpt, verbose=False)
    rs = [perplexity(model, s, len(s) - 1) for s in seqs]
    return math.exp(sum(r.nll for r in rs) / sum(r.tokens for r in rs))


def test_card_table_matches_an_independent_eval(build):
    res, calib = build
    report = json.loads((res.out / "saliency.json").read_text())
    lost = report["what_it_lost"]
    held = calib.heldout_by_domain()
    assert [r["domain"] for r in lost["domains"]] == list(held)
    assert lost["experts_kept_per_layer"] == {str(l): 8 for l in res.selection.kept}
    for row in lost["domains"]:
        seqs = held[row["domain"]]
        assert row["tokens"] == sum(len(s) - 1 for s in seqs)
        assert row["full_ppl"] == pytest.approx(_independent_ppl(MICRO_MOE, seqs), rel=2e-4)
        assert row["build_ppl"] == pytest.approx(_independent_ppl(res.out, seqs), rel=2e-4)
        assert 0 < row["routing_kept"] < 1 and row["gate_kl"] > 0
    card = (res.out / "README.md").read_text()
    assert "## What it lost" in card and f"{lost['domains'][0]['build_ppl']:.3f}" in card
    assert report["balance"] == "max" and "domain_score" in report["layers"][0]


def test_compare_of_a_model_with_itself_loses_nothing(micro_seqs):
    """Every expert kept, same weights: the gate figures are the no-loss values."""
    from kimi_mlx.prune.compare import compare
    from kimi_mlx.prune.writer import source_args

    _, args, _ = source_args(MICRO_MOE)
    kept = {l: list(range(args.num_experts)) for l in range(args.num_hidden_layers)
            if args.is_moe(l)}
    t = compare(MICRO_MOE, MICRO_MOE, {"code": micro_seqs["code"][:1]}, chunk=SEQ, kept=kept)
    r = t.rows[0]
    assert r.full_ppl == r.build_ppl and r.routing_kept == pytest.approx(1.0, abs=1e-6)
    # identical gates: only the smoothing is left, KL <= log(1 + eps E) (refit.gate_kl)
    from kimi_mlx.prune.refit import KL_EPS

    assert 0 <= r.gate_kl <= math.log(1 + KL_EPS * args.num_experts) + 1e-6


def test_eval_compare_end_to_end(build, tmp_path, capsys):
    from kimi_mlx.commands.main import main

    res, _ = build
    text = (MICRO_MOE / "heldout" / "prose.txt").read_text()[:1500]
    (tmp_path / "prose.txt").write_text(text)
    out_json = tmp_path / "t.json"
    rc = main(["eval", "--compare", str(MICRO_MOE), str(res.out), str(tmp_path / "prose.txt"),
               "--seq-len", "128", "--quiet", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert rc == 0 and "| prose |" in printed and "Experts kept per layer: 8 of 32" in printed
    row = json.loads(out_json.read_text())["domains"][0]
    # independently: the file's tokens in consecutive pieces of 129, each one window
    ids = _tok().encode(text)
    pieces = [ids[i:i + 129] for i in range(0, len(ids), 129) if len(ids[i:i + 129]) >= 2]
    assert row["tokens"] == sum(len(p) - 1 for p in pieces)
    assert row["full_ppl"] == pytest.approx(_independent_ppl(MICRO_MOE, pieces), rel=2e-4)
    assert row["build_ppl"] == pytest.approx(_independent_ppl(res.out, pieces), rel=2e-4)
    assert f"{row['build_ppl']:.3f}" in printed
    assert main(["eval", "--compare", str(MICRO_MOE), str(res.out)]) == 2
    assert "needs DATA files" in capsys.readouterr().err


def test_bench_masked_scoring_equals_the_written_build(build):
    """The evidence bench scores a selection by masking the router; the written build
    (the pruner's writer) must give the same perplexity."""
    from kimi_mlx.prune.bench.domains import Scorer

    res, calib = build
    ids = [t for s in calib.heldout_by_domain()["data"] for t in s]
    sc = Scorer(MICRO_MOE, {"data": ids}, SEQ)
    masked = sc.score(res.selection.kept)["data"]
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.generation.evaluate import perplexity

    model, _, _ = load_model(res.out, verbose=False)
    assert masked == pytest.approx(perplexity(model, ids, SEQ).perplexity, rel=2e-4)
    assert sc.score(None)["data"] != masked


def test_bench_rule_picks_the_default_from_seed_noise():
    """Hand-made results: a candidate worse than uniform REAP beyond the seed noise in one
    cell is refused even with a lower mean; one within the noise everywhere and lower on
    the mean is chosen; the worst-domain ratio is per seed."""
    from kimi_mlx.prune.bench.domains import BASELINE, decide, worst_ratio

    def rows(vals):  # [(code, data) per seed]
        return [{"code": c, "data": d} for c, d in vals]
    cells = {"mix": {BASELINE: rows([(10, 5), (11, 5), (12, 5)]),         # code noise 2
                     "good": rows([(11, 4), (11.5, 4.1), (12.5, 4.2)]),    # +0.33 code, better data
                     "bad": rows([(13.5, 1), (13.5, 1), (13.5, 1)])}}      # +2.5 code > noise
    res = {"domains": ["code", "data"], "methods": [BASELINE, "good", "bad"],
           "full": {"code": 10.0, "data": 4.0},
           "keeps": {"0.25": {"n_keep": 8, "random": [], "cells": cells}}}
    v = decide(res)
    assert v["passes"]["good"][0] and not v["passes"]["bad"][0]
    assert v["gmean"]["bad"] < v["gmean"]["good"] < v["gmean"][BASELINE]
    assert v["choice"] == "good"
    # baseline-only noise: the data cell has no REAP seed spread, so 'good' still passes
    # there (it is better), and the choice is the same
    assert decide(res, "baseline")["choice"] == "good"
    assert worst_ratio(res, "good") == pytest.approx([1.1, 1.15, 1.25])

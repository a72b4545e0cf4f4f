"""The micro-moe test bed: its third corpus domain and its specialisation figure."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

import kimi_mlx
from kimi_mlx.micro.corpus import ALL_DOMAINS, DOMAINS, build_corpus
from kimi_mlx.micro.moe import specialisation

ASSET = Path(kimi_mlx.__file__).resolve().parent / "assets" / "micro-moe"


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(domains=ALL_DOMAINS)


def _parse(text: str):
    """Records of a data document, read with the json / csv modules (not our writer)."""
    if text.startswith("{\n"):
        return json.loads(text)["rows"]
    if text.startswith("{"):
        return [json.loads(line) for line in text.splitlines()]
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows, text[:200]
    return rows


def test_data_documents_are_valid_json_or_csv_and_held_out_by_block(corpus):
    docs = corpus.train["data"] + corpus.heldout["data"]
    assert len(docs) > 100 and corpus.heldout["data"]
    styles = set()
    for d in docs:
        recs = _parse(d.text)
        assert 0 < len(recs) <= 48 and all(isinstance(r, dict) for r in recs), d.source
        styles.add(d.text[:2])
    assert len(styles) >= 3  # JSON lines, JSON array and CSV all occur
    train = {d.text for d in corpus.train["data"]}
    assert not train & {d.text for d in corpus.heldout["data"]}


def test_two_domain_corpus_is_unchanged_by_the_third(corpus):
    """`make micro`'s corpus (code, prose) is the same documents whether or not data is read."""
    two = build_corpus()
    assert two.domains == DOMAINS
    for split in ("train", "heldout"):
        for d in DOMAINS:
            assert [x.text for x in getattr(two, split)[d]] == [x.text for x in getattr(corpus, split)[d]]
    with pytest.raises(ValueError, match="unknown corpus domain"):
        build_corpus(domains=("code", "poetry"))


def test_specialisation_figures():
    uniform = np.full((2, 8), 1 / 8)
    sp = specialisation(uniform)
    assert sp["best_half"] == pytest.approx([0.5, 0.5]) and sp["random_half"] == pytest.approx([0.5, 0.5])
    peaked = np.array([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0]])
    sp = specialisation(peaked, seeds=5)
    assert sp["best_half"] == pytest.approx([0.9])
    lo, hi = sp["random_half_range"][0]
    assert lo <= sp["random_half"][0] <= hi <= 0.9


def test_shipped_card_states_the_measured_figures():
    info = json.loads((ASSET / "eval.json").read_text())
    card = (ASSET / "MODEL_CARD.md").read_text()
    ev = info["eval"]
    assert ev["domains"] == list(ALL_DOMAINS) and info["training"]["bias_step"] == 0.0
    for d in ev["domains"]:
        sp = ev["specialisation"][d]
        row = f"| {d} | " + " | ".join(f"{100 * b:.0f}% / {100 * r:.0f}%"
                                       for b, r in zip(sp["best_half"], sp["random_half"]))
        assert row in card
        share = np.array(ev["share"][d])
        np.testing.assert_allclose(share.sum(axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(np.sort(share, axis=1)[:, ::-1][:, : share.shape[1] // 2].sum(axis=1),
                                   sp["best_half"], rtol=1e-9)
    assert "Unicode License v3" in card and "PSF License" in card


def test_domain_structure_tells_specialisation_from_collapse():
    from kimi_mlx.micro.moe import domain_structure

    E = 8
    a = np.r_[np.full(4, 0.25), np.zeros(4)][None]  # experts 0-3
    b = np.r_[np.zeros(4), np.full(4, 0.25)][None]  # experts 4-7: disjoint
    st = domain_structure({"a": a, "b": b})
    assert st["best_half_overlap"]["a-b"] == [0.0]
    assert st["pooled_effective_experts"][0] == pytest.approx(E)  # all 8 used overall
    assert st["pooled_unused"] == [0] and st["pooled_top4"][0] == pytest.approx(0.5)
    collapsed = np.r_[np.full(2, 0.5), np.zeros(6)][None]
    st = domain_structure({"a": collapsed, "b": collapsed})
    assert st["best_half_overlap"]["a-b"] == [1.0]
    assert st["pooled_effective_experts"][0] == pytest.approx(2.0) and st["pooled_unused"] == [6]


def test_sequence_expert_mi_against_numpy():
    import mlx.core as mx

    from kimi_mlx.micro.train import sequence_expert_mi

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, 5, 6)).astype(np.float32)
    p = np.exp(logits / 0.5)
    p /= p.sum(-1, keepdims=True)
    rows = p.mean(1)
    H = lambda q: -(q * np.log(q)).sum(-1)  # noqa: E731
    want = H(rows.mean(0)) - H(rows).mean()
    got = sequence_expert_mi(mx.array(logits), 0.5).item()
    assert got == pytest.approx(want, rel=1e-4)
    # rows routed alike carry no information about the row
    same = np.repeat(logits[:1], 3, axis=0)
    assert sequence_expert_mi(mx.array(same)).item() == pytest.approx(0.0, abs=1e-5)

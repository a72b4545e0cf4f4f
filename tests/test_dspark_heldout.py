"""micro-dspark's held-out comparison (`kimi_mlx.micro.dspark_eval`) reads text the
drafter never trained on, and the trainer's copy-heavy prompts quote their own span."""

from pathlib import Path

import numpy as np
import pytest

from kimi_mlx.micro.corpus import build_corpus

REPO = Path(__file__).resolve().parents[1]
HELD = REPO / "kimi_mlx/assets/micro/heldout"


@pytest.fixture(scope="module")
def corpus():
    c = build_corpus()
    if c.python_version.split()[-1] != "3.11.7":
        pytest.skip(f"micro's corpus is Python 3.11.7's stdlib, this is {c.python_version}")
    return c


def test_heldout_eval_text_is_outside_the_training_split(corpus):
    """The files `dspark_eval` prompts from are the corpus's held-out split (code: a prefix
    of it), held out by document; and the prompts it takes from them share no 64-character
    window (any offset) with the training text the trainer draws its prompts from (held-out
    prose alone would: the language reference repeats paragraphs across topics)."""
    from kimi_mlx.micro.dspark_eval import heldout_prompts
    from kimi_mlx.text.tokenizer import KimiTokenizer

    train = {}
    for d in ("code", "prose"):
        shipped = (HELD / f"{d}.txt").read_text(encoding="utf-8")
        assert corpus.text("heldout", d).startswith(shipped.rstrip("\n")), d
        assert not {x.source for x in corpus.train[d]} & {x.source for x in corpus.heldout[d]}
        train[d] = corpus.text("train", d)
    tok = KimiTokenizer.from_pretrained(REPO / "kimi_mlx/assets/micro")
    prompts = heldout_prompts(REPO / "kimi_mlx/assets/micro", tok)
    assert sorted(prompts) == ["code", "copy", "prose"]
    for w, ps in prompts.items():
        assert len(ps) == 4 and len({tuple(p) for p in ps}) == 4
        text = train["prose" if w == "prose" else "code"]
        for p in ps:
            t = tok.decode(p)
            assert all(t[s:s + 64] not in text for s in range(max(1, len(t) - 63))), (w, t[:60])


def test_copy_prompts_quote_the_start_of_their_span():
    from kimi_mlx.micro.dspark_train import copy_prompts

    stream = np.arange(1000, dtype=np.int32) + 7
    sep = [1, 2]
    out = copy_prompts(stream, 5, np.random.default_rng(0), 96, sep)
    assert out.shape == (5, 96) and out.dtype == np.int32
    span = (96 - 2) * 2 // 3
    for row in out:
        o = row[0] - 7  # the stream is its own index: the span's offset
        assert list(row[:span]) == list(range(o + 7, o + 7 + span))
        assert list(row[span:span + 2]) == sep
        assert list(row[span + 2:]) == list(row[:96 - span - 2])

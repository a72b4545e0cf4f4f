"""Byte-level BPE trainer: hand-computed merge orders, tiktoken round trips, and the
pre-tokenizer checked against tiktoken's own regex engine."""

import random
import time

import pytest
import tiktoken

from kimi_mlx.text import bpe

# The K2/K3 pre-tokenizer, copied from the spec (not imported from the code under test).
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

TRICKY = [
    "Hello World's HELLO'LL don't I'M we've",
    "你好世界abc中文English 日本語のテキスト 한국어",
    "12345 1234567 ٣٤٥٦ Ⅻ ½",
    "e\u0301tude éÉtude ǅungla ﬁne",
    "  \n\n  x\r\n\tπ√ a\u00a0b\u3000c\x0bd\x0ce\x85f\u2028g",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "emoji 👍🏽 and ZWJ 👨‍👩‍👧 !!! ??? ...",
    "trailing spaces   ",
    "\n",
    "",
]


def learned(ranks):
    """The merged tokens in rank order (ranks 256..)."""
    return [t for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])][256:]


def test_single_bytes_first_in_byte_order():
    ranks = bpe.train_bpe("abc abc", 300)
    for b in range(256):
        assert ranks[bytes([b])] == b
    assert sorted(ranks.values()) == list(range(len(ranks)))


def test_hand_computed_merge_order():
    # Pre-tokens: "low", " lower", " lowest", " low" (one each).
    # Pair counts: (l,o)=4 (o,w)=4 ( ,l)=3 (w,e)=2, rest 1.
    #  1. tie at 4: left b"l" < b"o"            -> "lo"
    #  2. (lo,w)=4                              -> "low"
    #  3. ( ,low)=3                             -> " low"
    #  4. ( low,e)=2                            -> " lowe"
    #  then every pair occurs once (< min_count=2): stop.
    text = "low lower lowest low"
    assert learned(bpe.train_bpe(text, 1000)) == [b"lo", b"low", b" low", b" lowe"]
    # With min_count=1 the ties at 1 go to the smallest (left, right) bytes:
    # ( lowe,r) < ( lowe,s) < (s,t) -> " lower", then ( lowes... ) etc.
    assert learned(bpe.train_bpe(text, 1000, min_count=1)) == [
        b"lo", b"low", b" low", b" lowe", b" lower", b" lowes", b" lowest"
    ]
    # vocab_size caps the number of merges.
    assert learned(bpe.train_bpe(text, 258)) == [b"lo", b"low"]


def test_merges_respect_pretoken_boundaries():
    # "12345 12345" splits into "123","45"," ","123","45": no "34" and no "5 " merge.
    # (1,2)=(2,3)=(4,5)=2: smallest left first -> "12", then (12,3) vs (4,5) -> "123", "45".
    assert learned(bpe.train_bpe("12345 12345", 1000)) == [b"12", b"123", b"45"]
    # "ab ab": pieces "ab"," ab" -> "ab" (2), then " ab" (1, min_count=1); never "b ".
    assert learned(bpe.train_bpe("ab ab", 1000, min_count=1)) == [b"ab", b" ab"]


def test_overlapping_pairs_merge_left_to_right():
    # "aaaa": (a,a) counted 3 times; merging left to right gives [aa, aa] -> "aaaa".
    assert learned(bpe.train_bpe("aaaa", 1000, min_count=1)) == [b"aa", b"aaaa"]
    # "aaa": [aa, a] -> "aaa".
    assert learned(bpe.train_bpe("aaa", 1000, min_count=1)) == [b"aa", b"aaa"]


def test_deterministic_and_document_order_independent():
    docs = ["the cat sat on the mat", "the dog ate the hat", "a cat and a dog"] * 3
    r1 = bpe.train_bpe(docs, 300, min_count=1)
    r2 = bpe.train_bpe(list(reversed(docs)), 300, min_count=1)
    assert r1 == r2


def test_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        bpe.train_bpe("abc", 100)
    with pytest.raises(ValueError, match="min_count"):
        bpe.train_bpe("abc", 300, min_count=0)


def _corpus(n_words=6000, seed=0):
    rng = random.Random(seed)
    vocab = ["the", "of", "and", "token", "merge", "Kimi", "MLX", "apple", "silicon", "def",
             "return", "你好", "世界", "数据", "模型", "über", "naïve", "café", "日本", "123",
             "4567", "don't", "it's", "(x)", "x**2", "->", "\n", "\n\n", "  ", "👍"]
    letters = "etaoinshrdlucmfwyp"
    vocab += ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(400)]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def _random_text(rng, n):
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF),
              (0x3040, 0x30FF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x0, 0x1F), (0x2000, 0x206F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_tiktoken_round_trip_with_learned_ranks():
    corpus = _corpus()
    ranks = bpe.train_bpe(corpus, 256 + 300)
    assert len(ranks) == 556
    enc = tiktoken.Encoding("learned", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens={})
    # The learned tokens compress the training text.
    ids = enc.encode_ordinary(corpus)
    assert len(ids) < len(corpus.encode()) / 1.5
    assert enc.decode(ids) == corpus
    rng = random.Random(1)
    for text in TRICKY + [_random_text(rng, rng.randint(1, 200)) for _ in range(200)]:
        assert enc.decode(enc.encode_ordinary(text)) == text


def test_pretokenize_matches_tiktoken_split():
    """regex(V1) pieces == tiktoken's pieces.

    Reference: a tiktoken Encoding whose vocabulary holds every piece we produce as one
    token. tiktoken looks a whole pre-token up before running BPE, so its output is
    exactly one token per *its own* piece when the splits agree; a different split shows
    up as different ids (byte-level fallback pieces)."""
    rng = random.Random(2)
    texts = TRICKY + [_random_text(rng, rng.randint(1, 120)) for _ in range(150)] + [_corpus(400, 3)]
    for text in texts:
        assert "".join(bpe.pretokenize(text)) == text
    ranks = {bytes([i]): i for i in range(256)}
    for text in texts:
        for piece in bpe.pretokenize(text):
            ranks.setdefault(piece.encode(), len(ranks))
    enc = tiktoken.Encoding("split", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens={})
    for text in texts:
        ours = [ranks[p.encode()] for p in bpe.pretokenize(text)]
        assert enc.encode_ordinary(text) == ours, text


def test_hand_split_examples():
    assert bpe.pretokenize("Hello World's 你好abc 12345") == [
        "Hello", " World's", " ", "你好", "abc", " ", "123", "45"
    ]
    assert bpe.pretokenize("x  \n\ny") == ["x", "  \n\n", "y"]


def test_speed_small():
    # ~130 KB, 500 merges: a few tenths of a second; the 5 MB / 4000-merge case scales
    # roughly linearly in unique pre-tokens (measured ~6 s on one core).
    corpus = _corpus(25000, 4) + " " + " ".join(f"w{i}x{i*7}" for i in range(3000))
    t0 = time.perf_counter()
    ranks = bpe.train_bpe(corpus, 756)
    assert len(ranks) == 756
    assert time.perf_counter() - t0 < 10

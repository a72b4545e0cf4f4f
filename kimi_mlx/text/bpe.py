"""Byte-level BPE trainer producing tiktoken ranks (for small Kimi-style vocabularies).

``train_bpe(texts, vocab_size)`` returns ``{token bytes: rank}``: ranks 0..255 are the
single bytes in byte order, then one rank per learned merge, in the order learned. The
result plugs straight into ``tiktoken.Encoding(pat_str=PAT_STR, mergeable_ranks=...)``
and :func:`kimi_mlx.text.tokenizer.write_tokenizer_files`.

Text is first split with Kimi's pre-tokenizer regex (``kimi_mlx.text.tokenizer.PAT_STR``,
run with the ``regex`` package in V1 mode, which is how it supports the ``&&`` class
intersection tiktoken's engine accepts), so merges never cross a pre-token boundary,
exactly as tiktoken applies them.

Training counts each distinct pre-token once with its frequency, keeps a pair -> count
table and a pair -> words index, and after each merge updates only the words that
contain the merged pair. The next merge is the most frequent pair; ties go to the pair
whose (left bytes, right bytes) sorts first, so the result is deterministic. A merge
whose bytes already exist as a token (``a+bc`` after ``ab+c``) reuses that token and
takes no new rank.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping

import regex

from kimi_mlx.text.tokenizer import PAT_STR

_PATTERN = None


def _pattern():
    global _PATTERN
    if _PATTERN is None:
        _PATTERN = regex.compile(PAT_STR, flags=regex.V1)
    return _PATTERN


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into Kimi pre-tokens (the pieces tiktoken BPE-encodes separately).

    Concatenating the pieces gives back ``text``.
    """
    return _pattern().findall(text)


def count_pretokens(texts: str | Iterable[str]) -> Counter:
    """``Counter`` of pre-token UTF-8 bytes over ``texts`` (a string or an iterable of
    strings, e.g. documents; pre-tokens never span two of them)."""
    if isinstance(texts, str):
        texts = [texts]
    pieces: Counter = Counter()
    findall = _pattern().findall
    for text in texts:
        pieces.update(findall(text))
    counts: Counter = Counter()
    for piece, n in pieces.items():
        counts[piece.encode("utf-8")] += n
    return counts


def train_bpe(
    texts: str | Iterable[str],
    vocab_size: int,
    *,
    min_count: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> dict[bytes, int]:
    """Learn byte-level BPE ranks from text.

    Args:
        texts: a string or an iterable of strings.
        vocab_size: number of ordinary tokens wanted (>= 256), special tokens excluded.
        min_count: stop when the best pair occurs fewer times than this.
        progress: optional ``callback(n_tokens, vocab_size)`` called every 100 merges.

    Returns ``{token bytes: rank}`` with ranks 0..len-1 (fewer than ``vocab_size``
    tokens if the corpus runs out of pairs). Raises ``ValueError`` if
    ``vocab_size < 256`` or ``min_count < 1``.
    """
    return train_bpe_from_counts(count_pretokens(texts), vocab_size, min_count=min_count, progress=progress)


def _merge_word(sym: list[int], a: int, b: int, new: int) -> list[int]:
    out = []
    i, n = 0, len(sym)
    while i < n:
        if i + 1 < n and sym[i] == a and sym[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(sym[i])
            i += 1
    return out


def train_bpe_from_counts(
    word_counts: Mapping[bytes, int],
    vocab_size: int,
    *,
    min_count: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> dict[bytes, int]:
    """:func:`train_bpe` on pre-counted pre-tokens ``{piece bytes: count}``."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the single bytes), got {vocab_size}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    index: dict[bytes, int] = {t: i for i, t in enumerate(vocab)}
    n_ranks = 256

    words: list[list[int]] = []
    counts: list[int] = []
    for w, c in sorted(word_counts.items()):
        if len(w) >= 2 and c > 0:
            words.append(list(w))
            counts.append(int(c))

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, sym in enumerate(words):
        c = counts[wi]
        for p in zip(sym, sym[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + c
            where.setdefault(p, set()).add(wi)

    # Lazy max-heap: an entry is live only while its count equals pair_counts[pair].
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    while n_ranks < vocab_size and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        c_best = pair_counts.get((a, b), 0)
        if c_best != -negc:
            continue
        if c_best < min_count:
            break
        merged = vocab[a] + vocab[b]
        new = index.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            index[merged] = new
            n_ranks += 1
        changed: set[tuple[int, int]] = set()
        for wi in where.pop((a, b), ()):
            sym = words[wi]
            c = counts[wi]
            old_pairs = list(zip(sym, sym[1:]))
            new_sym = _merge_word(sym, a, b, new)
            new_pairs = list(zip(new_sym, new_sym[1:]))
            for p in old_pairs:
                pair_counts[p] -= c
            for p in new_pairs:
                pair_counts[p] = pair_counts.get(p, 0) + c
            old_set, new_set = set(old_pairs), set(new_pairs)
            for p in old_set - new_set:
                if p != (a, b):
                    where[p].discard(wi)
            for p in new_set - old_set:
                where.setdefault(p, set()).add(wi)
            changed |= old_set | new_set
            words[wi] = new_sym
        pair_counts.pop((a, b), None)
        changed.discard((a, b))
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, vocab[p[0]], vocab[p[1]], p[0], p[1]))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
        if progress is not None and n_ranks % 100 == 0:
            progress(n_ranks, vocab_size)

    # Reused merges took no id, so token ids are already ranks 0..n-1 in learned order.
    return {t: i for i, t in enumerate(vocab)}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimi_mlx.text.bpe --vocab-size N --out DIR FILE...``: train on UTF-8 text
    files and write ``tiktoken.model`` + ``tokenizer_config.json`` with the K3 special
    tokens placed right after the learned ranks."""
    from kimi_mlx.text.tokenizer import kimi_special_tokens, write_tokenizer_files

    ap = argparse.ArgumentParser(prog="python -m kimi_mlx.text.bpe", description=main.__doc__)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--vocab-size", type=int, required=True, help="ordinary tokens, specials excluded")
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    texts = (f.read_text(encoding="utf-8") for f in args.files)
    ranks = train_bpe(
        texts,
        args.vocab_size,
        min_count=args.min_count,
        progress=lambda n, total: print(f"\r{n}/{total} tokens", end="", file=sys.stderr),
    )
    print(file=sys.stderr)
    model, config = write_tokenizer_files(args.out, ranks, kimi_special_tokens(len(ranks)))
    print(f"wrote {model} ({len(ranks)} ranks) and {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibration data for `kimi-mlx prune`: files in, token-id sequences out.

Accepted inputs (`--calib`, one or more paths; a folder is read recursively in sorted
order, hidden files skipped):

* `*.jsonl` / `*.json` with one record per line. A record with `messages` (OpenAI-style
  chat) goes through the K3.1 chat encoding (`chat_format.encode_chat`, no generation
  prompt; `reasoning_effort` and `tools` are honoured when the record has them); a record
  with `prompt` (+ optional `completion`) or `text` is plain text; `input_ids` (a list of
  ints) is taken as already tokenised.
* any other file: plain UTF-8 text, one document per file.

Every document is split into sequences of at most `seq_len` tokens. Sequences are put in
a seeded pseudo-random order (so a token budget samples all files, not the first ones)
and taken until `max_tokens`.

**Domains** (for domain-balanced saliency, `saliency.BALANCES`, and the per-domain table
of the build's card): a record's `domain` field (a non-empty string) if it has one, else
the name of the subfolder of a `--calib` folder the file sits in, else the file's name
without its suffix. A folder `calib/` holding `code.txt`, `prose.txt` and `zh/*.jsonl`
has the domains code, prose and zh. With more than one domain the token budget is shared
out evenly: sequences are taken round-robin over the domains (each in its seeded order)
until `max_tokens`, so a large file does not crowd out a small one.

**Held-out split** (`heldout_tokens` > 0): up to `heldout_tokens` tokens a domain of
held-out text (`CalibSet.heldout`), never calibrated on, and at most a quarter of the
domain's calibration tokens (so measuring the build costs at most about half the
calibration pass), from the sequences the token budget left over; a domain whose data the budget used up gives up its first calibration
sequences instead, at most a tenth of its calibration tokens (never its last sequence). REAP (arXiv 2510.13999, s.4) calibrates on a few hundred
thousand tokens of the target domain; the defaults here are smaller because the activations
of every sequence are kept between layers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

DEFAULT_SEQ_LEN = 2048
DEFAULT_MAX_TOKENS = 131072
JSONL_SUFFIXES = (".jsonl", ".json")
MIN_SEQ_TOKENS = 2  # a 1-token tail sequence carries no context; dropped


class CalibError(ValueError):
    """Calibration data that cannot be used (missing, empty, malformed); names the file."""


@dataclass
class CalibSet:
    """Tokenised calibration data.

    Attributes:
        sequences: token-id lists, each 2..seq_len long.
        sources: where each sequence came from ("file" or "file:line"), same order.
        files: the input files read.
        documents: number of documents (records or text files) read.
        kinds: documents per kind ("chat", "text", "ids").
        seq_len: the split length used.
        domains: the domain of each sequence, same order as `sequences` (see the module
            docstring).
        heldout: (domain, token ids) sequences set aside for evaluation, not calibrated on.
    """

    sequences: List[List[int]]
    sources: List[str]
    files: List[str]
    documents: int
    kinds: dict = field(default_factory=dict)
    seq_len: int = DEFAULT_SEQ_LEN
    domains: List[str] = field(default_factory=list)
    heldout: List[Tuple[str, List[int]]] = field(default_factory=list)

    def __post_init__(self):
        if not self.domains:
            self.domains = ["all"] * len(self.sequences)
        if len(self.domains) != len(self.sequences):
            raise ValueError(f"CalibSet: {len(self.domains)} domains for "
                             f"{len(self.sequences)} sequences")

    @property
    def domain_names(self) -> List[str]:
        """The calibration domains in first-seen order (held-out ones included)."""
        seen: dict = {}
        for d in list(self.domains) + [d for d, _ in self.heldout]:
            seen.setdefault(d, None)
        return list(seen)

    def domain_tokens(self) -> dict:
        """{domain: calibration tokens}."""
        out: dict = {d: 0 for d in self.domain_names}
        for d, s in zip(self.domains, self.sequences):
            out[d] += len(s)
        return out

    def heldout_by_domain(self) -> dict:
        """{domain: [token id sequences]} of the held-out split."""
        out: dict = {}
        for d, s in self.heldout:
            out.setdefault(d, []).append(s)
        return out

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def describe(self) -> str:
        """One line for logs and the model card."""
        if not self.sequences:
            return "no calibration data (the random method needs none)"
        kinds = ", ".join(f"{n} {k} document{'s' * (n != 1)}" for k, n in sorted(self.kinds.items()))
        files = self.files[0] if len(self.files) == 1 else f"{len(self.files)} files"
        doms = self.domain_tokens()
        dom = ("" if len(doms) < 2 else "; domains " + ", ".join(
            f"{d} {n:,}" for d, n in doms.items()))
        held = (f"; {sum(len(s) for _, s in self.heldout):,} tokens held out"
                if self.heldout else "")
        return (f"{self.num_tokens:,} tokens in {len(self.sequences)} sequences of <= "
                f"{self.seq_len} tokens from {files} ({kinds}){dom}{held}")


def list_files(paths: Sequence) -> List[Path]:
    """Input files named by `paths` (files, or folders read recursively, sorted).

    Raises:
        CalibError: no paths, a path that does not exist, or no files at all.
    """
    return [f for f, _ in domain_files(paths)]


def domain_files(paths: Sequence) -> List[Tuple[Path, str]]:
    """(file, domain) of every input file named by `paths`: the domain is the subfolder
    of a given folder the file sits in, else the file's name without its suffix.

    Raises:
        CalibError: no paths, a path that does not exist, or no files at all.
    """
    if not paths:
        raise CalibError("no calibration data given (--calib FILE_OR_FOLDER)")
    out: List[Tuple[Path, str]] = []
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists():
            raise CalibError(f"{p}: calibration data not found")
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise CalibError(f"{p}: calibration folder has no files")
            for f in found:
                parts = f.relative_to(p).parts
                out.append((f, parts[0] if len(parts) > 1 else f.stem))
        else:
            out.append((p, p.stem))
    return out


def _records(path: Path) -> Iterator[Tuple[int, dict]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise CalibError(f"{path}: not UTF-8 text ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibError(f"{path}:{n}: not a JSON record ({e.msg})") from None
        if not isinstance(rec, dict):
            raise CalibError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
        yield n, rec


def _record_ids(rec: dict, where: str, tokenizer) -> Tuple[str, List[int]]:
    """(kind, token ids) of one JSONL record."""
    if "input_ids" in rec:
        ids = rec["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise CalibError(f"{where}: input_ids must be a list of non-negative ints")
        return "ids", ids
    tok = tokenizer()
    if "messages" in rec:
        from kimi_mlx.text.chat_format import DEFAULT_EFFORT, encode_chat

        try:
            return "chat", encode_chat(
                tok, rec["messages"], reasoning_effort=rec.get("reasoning_effort") or DEFAULT_EFFORT,
                add_generation_prompt=False, tools=rec.get("tools"))
        except (ValueError, TypeError) as e:
            raise CalibError(f"{where}: cannot chat-encode the record ({e})") from None
    if "prompt" in rec or "text" in rec:
        parts = [rec.get("prompt"), rec.get("completion")] if "prompt" in rec else [rec["text"]]
        if not all(p is None or isinstance(p, str) for p in parts):
            raise CalibError(f"{where}: prompt/completion/text must be strings")
        return "text", tok.encode("".join(p for p in parts if p))
    raise CalibError(f"{where}: a record needs 'messages', 'prompt', 'text' or 'input_ids' "
                     f"(got keys {sorted(rec)[:8]})")


def _split(ids: List[int], seq_len: int) -> List[List[int]]:
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)
            if len(ids[i:i + seq_len]) >= MIN_SEQ_TOKENS]


def load_calibration(
    paths: Sequence,
    tokenizer: Callable[[], object],
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
    seed: int = 0,
    vocab_size: Optional[int] = None,
    heldout_tokens: int = 0,
) -> CalibSet:
    """Read, tokenise and split calibration data.

    Args:
        paths: files or folders (see the module docstring for formats).
        tokenizer: zero-argument callable returning a `KimiTokenizer`; called only when
            a document needs tokenising (pre-tokenised `input_ids` records need none).
        seq_len: maximum tokens per sequence (documents are split, not truncated).
        max_tokens: token budget over all sequences (None: everything).
        seed: order of sequences before the budget is applied.
        vocab_size: if given, token ids must be below it.
        heldout_tokens: tokens per domain set aside as held-out text (0: none).
    Returns:
        CalibSet (with each sequence's domain, see the module docstring).
    Raises:
        CalibError: missing path, malformed record (file:line), a `domain` field that is
            not a non-empty string, or no tokens at all.
    """
    if seq_len < MIN_SEQ_TOKENS:
        raise CalibError(f"--seq-len must be at least {MIN_SEQ_TOKENS}, got {seq_len}")
    if max_tokens is not None and max_tokens < MIN_SEQ_TOKENS:
        raise CalibError(f"--calib-tokens must be at least {MIN_SEQ_TOKENS}, got {max_tokens}")
    cached = []

    def tok():
        if not cached:
            try:
                cached.append(tokenizer())
            except (OSError, ValueError) as e:
                raise CalibError(f"cannot load the tokenizer to encode calibration text: {e}") from None
        return cached[0]

    if heldout_tokens < 0:
        raise CalibError(f"held-out tokens must be >= 0, got {heldout_tokens}")
    listed = domain_files(paths)
    files = [f for f, _ in listed]
    seqs: List[Tuple[str, str, List[int]]] = []
    kinds: dict = {}
    documents = 0
    for f, fdomain in listed:
        if f.suffix.lower() in JSONL_SUFFIXES:
            docs: Iterable = ((f"{f}:{n}", *_record_ids(rec, f"{f}:{n}", tok),
                               _record_domain(rec, f"{f}:{n}", fdomain))
                              for n, rec in _records(f))
        else:
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CalibError(f"{f}: not UTF-8 text ({e})") from None
            docs = [(str(f), "text", tok().encode(text), fdomain)] if text.strip() else []
        for where, kind, ids, dom in docs:
            documents += 1
            kinds[kind] = kinds.get(kind, 0) + 1
            if vocab_size is not None and ids and max(ids) >= vocab_size:
                raise CalibError(f"{where}: token id {max(ids)} is outside the vocabulary "
                                 f"({vocab_size})")
            seqs += [(where, dom, s) for s in _split(ids, seq_len)]
    if not seqs:
        names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise CalibError(f"calibration data is empty: no tokens in {names}")
    random.Random(seed).shuffle(seqs)
    by_domain: dict = {}
    for item in seqs:
        by_domain.setdefault(item[1], []).append(item)
    # round-robin over the domains so a token budget is shared out evenly between them
    queues = [list(q) for q in by_domain.values()]
    order = []
    while queues:
        order += [q.pop(0) for q in queues]
        queues = [q for q in queues if q]
    out: List[Tuple[str, str, List[int]]] = []
    total, used = 0, 0
    for where, dom, s in order:
        if max_tokens is not None and total >= max_tokens:
            break
        used += 1
        if max_tokens is not None and total + len(s) > max_tokens:
            s = s[: max_tokens - total]
            if len(s) < MIN_SEQ_TOKENS:
                break
        out.append((where, dom, s))
        total += len(s)
    held = _heldout(order[used:], out, heldout_tokens) if heldout_tokens else []
    return CalibSet(
        sequences=[s for _, _, s in out], sources=[w for w, _, _ in out],
        files=[str(f) for f in files], documents=documents, kinds=kinds, seq_len=seq_len,
        domains=[d for _, d, _ in out], heldout=held,
    )


def _heldout(left: List[tuple], out: List[tuple], per_domain: int) -> List[Tuple[str, List[int]]]:
    """Held-out (domain, ids) of up to `per_domain` tokens a domain, and at most a quarter
    of its calibration tokens: from the sequences the budget left over (`left`, in order;
    a domain the budget gave no calibration token has none); a domain with none left over gives up the first of
    its calibration sequences in `out` (removed from it in place), at most a tenth of its
    calibration tokens and never its last sequence."""
    held: List[Tuple[str, List[int]]] = []
    got: dict = {}
    calibrated: dict = {}
    for _, dom, s in out:
        calibrated[dom] = calibrated.get(dom, 0) + len(s)
    for _, dom, s in left:
        have = got.get(dom, 0)
        cap = min(per_domain, calibrated.get(dom, 0) // 4)
        if have < cap:
            s = s[: cap - have]
            if len(s) >= MIN_SEQ_TOKENS:
                held.append((dom, s))
                got[dom] = have + len(s)
    for dom in dict.fromkeys(d for _, d, _ in out):
        if dom in got:
            continue
        mine = [k for k, item in enumerate(out) if item[1] == dom]
        cap = min(per_domain, sum(len(out[k][2]) for k in mine) // 10)
        taken, drop = 0, []
        for k in mine[:-1]:
            if taken + len(out[k][2]) > cap:
                break
            held.append((dom, out[k][2]))
            taken += len(out[k][2])
            drop.append(k)
        for k in reversed(drop):
            del out[k]
    return held


def _record_domain(rec: dict, where: str, default: str) -> str:
    """A JSONL record's `domain` field, else `default` (its file's domain)."""
    if "domain" not in rec:
        return default
    d = rec["domain"]
    if not isinstance(d, str) or not d.strip():
        raise CalibError(f"{where}: 'domain' must be a non-empty string, got {d!r}")
    return d.strip()

"""The micro models' corpora, read from the running Python's standard library.

`make micro` reads two domains (code, prose); `make micro-moe` adds a third, **data**
(`data_documents`), with `build_corpus(domains=ALL_DOMAINS)`.

Both domains ship with every CPython install, so nothing is downloaded:

* **code**: the stdlib's own `.py` sources (`sysconfig.get_paths()["stdlib"]`), without
  tests, generated tables (`encodings/`, `pydoc_data/`) and files over 100 kB. Files are
  put in a deterministic pseudo-random order (SHA-256 of the relative path) and taken
  until `CODE_BYTES`, so the selection spreads over the whole library.
* **prose**: English documentation text: the Python language reference topics in
  `pydoc_data/topics.py` (read with `ast`, not imported), the stdlib `LICENSE.txt`,
  IDLE's README / NEWS / HISTORY / TODO / CREDITS / extend texts and
  `email/architecture.rst`.

Held-out split, about 1 in 10 per domain and deterministic: code by file (SHA-256 of the
relative path), prose by blocks of consecutive paragraphs (SHA-256 of the block text), so
held-out prose is never seen in training while topics still appear on both sides.

* **data** (micro-moe only): structured records generated from data that ships inside
  Python: the Unicode Character Database as compiled into `unicodedata` (name, general
  category, bidi class, decimal value, East Asian width, decomposition of each assigned
  code point with its own name; Unicode License v3) and stdlib tables (`http.HTTPStatus`,
  `mimetypes.types_map`, `locale.locale_alias`, `encodings.aliases`, `keyword.kwlist`;
  PSF License). One document is a block of records written as JSON lines, a JSON array
  or CSV with a header (chosen by hash), held out by block like prose.

The corpus depends on the interpreter's version (its stdlib); `Corpus.fingerprint`
(SHA-256 over every document) tells whether two machines read the same text.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

DOMAINS = ("code", "prose")
ALL_DOMAINS = ("code", "prose", "data")  # micro-moe's three domains
DATA_BYTES = 1_200_000  # data selected (train + held-out), bytes of UTF-8 text
DATA_BLOCK = 48  # records per data document
CODE_BYTES = 2_400_000  # code selected (train + held-out), bytes of UTF-8 text
MAX_FILE_BYTES = 100_000  # skip bigger .py files (tables, generated code)
MIN_FILE_BYTES = 200  # skip near-empty __init__.py and friends
HELDOUT_MOD = 10  # 1 in HELDOUT_MOD files / prose blocks is held out
PROSE_BLOCK_CHARS = 1500  # prose is split into blocks of consecutive paragraphs this long
SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data", "lib2to3", "ensurepip", "__phello__",
}
PROSE_FILES = (
    "LICENSE.txt",
    "email/architecture.rst",
    "idlelib/README.txt",
    "idlelib/HISTORY.txt",
    "idlelib/NEWS.txt",
    "idlelib/NEWS2x.txt",
    "idlelib/TODO.txt",
    "idlelib/CREDITS.txt",
    "idlelib/extend.txt",
)
SEPARATOR = "\n\n"  # between documents when a domain is joined into one text


@dataclass
class Document:
    """One unit of text: a source file, a documentation topic, or a block of paragraphs."""

    domain: str  # "code", "prose" or "data"
    source: str  # path relative to the stdlib (plus "#topic" / "#block" where split)
    text: str


@dataclass
class Corpus:
    """Train and held-out documents per domain, and where they came from."""

    stdlib: str
    python_version: str
    train: Dict[str, List[Document]] = field(default_factory=dict)
    heldout: Dict[str, List[Document]] = field(default_factory=dict)
    domains: tuple = DOMAINS

    def text(self, split: str, domain: str) -> str:
        """All documents of `split` ("train" | "heldout") and `domain` joined by SEPARATOR."""
        docs = getattr(self, split)[domain]
        return SEPARATOR.join(d.text for d in docs)

    @property
    def fingerprint(self) -> str:
        """SHA-256 (hex) over split, domain, source and text of every document."""
        h = hashlib.sha256()
        for split in ("train", "heldout"):
            for domain in self.domains:
                for d in getattr(self, split)[domain]:
                    for part in (split, domain, d.source, d.text):
                        h.update(part.encode("utf-8"))
                        h.update(b"\0")
        return h.hexdigest()

    def stats(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """{split: {domain: {"documents": n, "chars": n, "bytes": n}}}."""
        out: Dict[str, Dict[str, Dict[str, int]]] = {}
        for split in ("train", "heldout"):
            out[split] = {}
            for domain in self.domains:
                text = self.text(split, domain)
                out[split][domain] = {
                    "documents": len(getattr(self, split)[domain]),
                    "chars": len(text),
                    "bytes": len(text.encode("utf-8")),
                }
        return out


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder (`sysconfig` "stdlib")."""
    return Path(sysconfig.get_paths()["stdlib"])


def _digest(s: str) -> int:
    return int(hashlib.sha256(s.encode("utf-8")).hexdigest()[:16], 16)


def _read(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n"


def code_files(stdlib: Path) -> List[str]:
    """Candidate `.py` files (relative POSIX paths, sorted) under `stdlib`."""
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(
            d for d in dirs if d not in SKIP_DIRS and not d.startswith(("config-", "."))
        )
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            p = Path(root) / f
            if MIN_FILE_BYTES <= p.stat().st_size <= MAX_FILE_BYTES:
                out.append(p.relative_to(stdlib).as_posix())
    return sorted(out)


def code_documents(stdlib: Path, budget: int = CODE_BYTES) -> List[Document]:
    """Stdlib sources in SHA-256(path) order until `budget` bytes; one Document per file."""
    docs, total = [], 0
    for rel in sorted(code_files(stdlib), key=lambda r: (_digest("select:" + r), r)):
        text = _read(stdlib / rel)
        n = len(text.encode("utf-8"))
        if total + n > budget:
            continue
        docs.append(Document("code", rel, text))
        total += n
    return docs


def _topics(stdlib: Path) -> Dict[str, str]:
    """`pydoc_data/topics.py`'s `topics` dict, parsed with `ast` (the file is not run)."""
    path = stdlib / "pydoc_data" / "topics.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no `topics = {{...}}` assignment")


def _blocks(text: str, size: int = PROSE_BLOCK_CHARS) -> List[str]:
    """Split text at blank lines into blocks of whole paragraphs of about `size` chars."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    blocks, cur = [], []
    for p in paras:
        cur.append(p)
        if sum(len(c) + 2 for c in cur) >= size:
            blocks.append("\n\n".join(cur))
            cur = []
    if cur:
        blocks.append("\n\n".join(cur))
    return blocks


def prose_documents(stdlib: Path) -> List[Document]:
    """Documentation text as blocks of paragraphs (Document per block, in reading order)."""
    sources = []
    for key, text in sorted(_topics(stdlib).items()):
        sources.append((f"pydoc_data/topics.py#{key}", text))
    for rel in PROSE_FILES:
        p = stdlib / rel
        if p.exists():
            sources.append((rel, _read(p)))
    docs = []
    for src, text in sources:
        text = text.replace("\r\n", "\n")
        for i, block in enumerate(_blocks(text)):
            docs.append(Document("prose", f"{src}#block{i}", block.strip("\n") + "\n"))
    return docs


def _data_records() -> List[tuple]:
    """(table name, header, rows) of the structured-data domain, in a fixed order."""
    import encodings.aliases
    import http
    import keyword
    import locale
    import mimetypes
    import unicodedata

    tables = []
    uni = []
    for cp in range(0x20, 0x30000):
        ch = chr(cp)
        name = unicodedata.name(ch, "")
        if not name or name.endswith(f"-{cp:04X}"):  # unnamed, or a derived name (CJK, Tangut...)
            continue
        uni.append([f"U+{cp:04X}", name, unicodedata.category(ch), unicodedata.bidirectional(ch),
                    unicodedata.decimal(ch, ""), unicodedata.east_asian_width(ch),
                    unicodedata.decomposition(ch)])
    tables.append(("unicode", ["code_point", "name", "category", "bidi", "decimal",
                               "east_asian_width", "decomposition"], uni))
    tables.append(("http_status", ["code", "phrase", "description"],
                   [[int(s), s.phrase, s.description] for s in http.HTTPStatus]))
    tables.append(("mime_types", ["extension", "type"],
                   [[k, v] for k, v in sorted(mimetypes.types_map.items())]))
    tables.append(("locale_alias", ["alias", "locale"],
                   [[k, v] for k, v in sorted(locale.locale_alias.items())]))
    tables.append(("encoding_alias", ["alias", "codec"],
                   [[k, v] for k, v in sorted(encodings.aliases.aliases.items())]))
    tables.append(("keywords", ["keyword", "length"], [[k, len(k)] for k in keyword.kwlist]))
    return tables


def _format_block(table: str, header: List[str], rows: List[list], style: int) -> str:
    import csv
    import io
    import json

    if style == 0:  # JSON lines
        return "\n".join(json.dumps(dict(zip(header, r)), ensure_ascii=False) for r in rows) + "\n"
    if style == 1:  # one JSON object holding an array
        return json.dumps({"table": table, "rows": [dict(zip(header, r)) for r in rows]},
                          ensure_ascii=False, indent=1) + "\n"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def data_documents(budget: int = DATA_BYTES) -> List[Document]:
    """Structured-data documents (see the module docstring): blocks of DATA_BLOCK records
    of each table, as JSON lines, a JSON array or CSV (chosen by SHA-256 of the block's
    name); unicode blocks are taken in SHA-256 order until `budget` bytes, the small
    stdlib tables always."""
    docs, total = [], 0
    for table, header, rows in _data_records():
        blocks = [(f"{table}#{i}", rows[i : i + DATA_BLOCK]) for i in range(0, len(rows), DATA_BLOCK)]
        blocks.sort(key=lambda b: (_digest("select:" + b[0]), b[0]))
        for src, block in blocks:
            text = _format_block(table, header, block, _digest("style:" + src) % 3)
            n = len(text.encode("utf-8"))
            if table == "unicode" and total + n > budget:
                continue
            docs.append(Document("data", src, text))
            total += n
    return docs


def is_heldout(doc: Document) -> bool:
    """Held out: code by relative path, prose and data by block text (about 1 in HELDOUT_MOD)."""
    key = doc.source if doc.domain == "code" else doc.text
    return _digest(f"heldout:{doc.domain}:{key}") % HELDOUT_MOD == 0


def build_corpus(stdlib: Optional[Path] = None, code_bytes: int = CODE_BYTES,
                 domains: tuple = DOMAINS) -> Corpus:
    """Read `domains` (a subset of ALL_DOMAINS, default code and prose) from `stdlib`
    (default: this interpreter's) and split them.

    Raises:
        FileNotFoundError: `stdlib` has no `pydoc_data/topics.py` (not a CPython stdlib).
    """
    import platform

    stdlib = Path(stdlib) if stdlib is not None else stdlib_dir()
    if not (stdlib / "pydoc_data" / "topics.py").exists():
        raise FileNotFoundError(f"{stdlib}: no pydoc_data/topics.py; not a CPython stdlib")
    unknown = [d for d in domains if d not in ALL_DOMAINS]
    if unknown:
        raise ValueError(f"unknown corpus domain(s) {unknown}; choose from {ALL_DOMAINS}")
    corpus = Corpus(str(stdlib), platform.python_version(), domains=tuple(domains))
    readers = {"code": lambda: code_documents(stdlib, code_bytes),
               "prose": lambda: prose_documents(stdlib), "data": data_documents}
    for domain in domains:
        docs = readers[domain]()
        corpus.train[domain] = [d for d in docs if not is_heldout(d)]
        corpus.heldout[domain] = [d for d in docs if is_heldout(d)]
    return corpus

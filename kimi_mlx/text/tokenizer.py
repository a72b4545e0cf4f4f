"""Kimi K3/K3.1 tokenizer: tiktoken byte-level BPE, read without running checkpoint code.

A Kimi checkpoint ships its tokenizer as two files (the same layout as Kimi K2):

* ``tiktoken.model``: one line per ordinary token, ``base64(token bytes) SPACE rank``,
  ranks 0..N-1 with no gaps;
* ``tokenizer_config.json``: the special tokens in ``added_tokens_decoder``
  (``{"163584": {"content": "[BOS]", ...}, ...}``) plus ``bos_token``/``eos_token``/
  ``pad_token``/``unk_token`` and ``"tokenizer_class": "TikTokenTokenizer"`` with an
  ``auto_map`` that points at the release's ``tokenization_kimi.py``.

We never import that Python file. :class:`KimiTokenizer` rebuilds the same
``tiktoken.Encoding`` (same ranks, same pre-tokenizer regex, same special tokens) from
the data files alone. ``kimi_mlx.text.hf_register.register_with_transformers`` makes
``transformers.AutoTokenizer`` (and therefore ``mlx_lm.load``) return our
transformers-compatible ``TikTokenTokenizer`` for such folders, without
``trust_remote_code``.

Importing this module is cheap: tiktoken is imported on first use, transformers never.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from kimi_mlx.text.chat_format import RenderedChat, encode_segments

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# The K2/K3 pre-tokenizer (`pat_str` of the release's tokenization_kimi.py). tiktoken's
# Rust regex engine accepts the `&&` class intersection; the Python `regex` package needs
# its V1 mode for it (see kimi_mlx.text.bpe).
PAT_STR = "|".join(
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

# Special tokens of the K3 release by offset from the first special id (163584 in the
# real 163840-token vocabulary). Offsets not listed are `<|reserved_token_{id}|>`.
NUM_SPECIAL_TOKENS = 256
_K3_SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}
END_OF_MSG = "<|end_of_msg|>"
MODEL_MAX_LENGTH = 1048576

_AUTO = object()  # "use the K3 default name if the vocabulary has it"

# Written into tokenizer_config.json like the release does; our loader never follows it,
# plain transformers (trust_remote_code=True) runs the folder's copy of REMOTE_CODE_SOURCE.
_RELEASE_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
REMOTE_CODE_FILE = "tokenization_kimi.py"
REMOTE_CODE_SOURCE = Path(__file__).with_name(REMOTE_CODE_FILE)


def kimi_special_tokens(first_id: int) -> dict[str, int]:
    """The K3 special-token table laid out from ``first_id``.

    Keeps the release's relative offsets, so ``kimi_special_tokens(163584)`` gives the
    real ids ([BOS] 163584 ... [PAD] 163839). Small test vocabularies pass their number
    of ranks. Returns 256 entries ``{content: id}``; gaps are named
    ``<|reserved_token_{id}|>`` like the release. Raises ``ValueError`` for a negative id.
    """
    if first_id < 0:
        raise ValueError(f"first_id must be >= 0, got {first_id}")
    by_offset = {off: name for name, off in _K3_SPECIAL_OFFSETS.items()}
    out = {}
    for off in range(NUM_SPECIAL_TOKENS):
        tid = first_id + off
        out[by_offset.get(off, f"<|reserved_token_{tid}|>")] = tid
    return out


# --------------------------------------------------------------------------- files


def _parse_tiktoken_model(path: Path) -> dict[bytes, int]:
    """Read ``base64 rank`` lines; every error names the file and line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: tokenizer rank file not found") from None
    ranks: dict[bytes, int] = {}
    seen_rank: dict[int, int] = {}
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            shown = line[:80].decode("utf-8", "replace")
            raise ValueError(f"{path}:{lineno}: expected 'base64 rank', got {shown!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            shown = parts[0][:80].decode("utf-8", "replace")
            raise ValueError(f"{path}:{lineno}: invalid base64 {shown!r}") from None
        try:
            rank = int(parts[1])
        except ValueError:
            shown = parts[1][:40].decode("utf-8", "replace")
            raise ValueError(f"{path}:{lineno}: rank {shown!r} is not an integer") from None
        if not token:
            raise ValueError(f"{path}:{lineno}: empty token")
        if rank < 0:
            raise ValueError(f"{path}:{lineno}: negative rank {rank}")
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: duplicate token {token!r} (already rank {ranks[token]})")
        if rank in seen_rank:
            raise ValueError(f"{path}:{lineno}: duplicate rank {rank} (also on line {seen_rank[rank]})")
        ranks[token] = rank
        seen_rank[rank] = lineno
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    return ranks


def _check_ranks(ranks: Mapping[bytes, int], source: str) -> None:
    n = len(ranks)
    values = set(ranks.values())
    if len(values) != n:
        raise ValueError(f"{source}: duplicate ranks")
    if min(values) != 0 or max(values) != n - 1:
        missing = sorted(set(range(max(values) + 1)) - values)[:5]
        raise ValueError(
            f"{source}: ranks must be 0..{n - 1} without gaps; first missing: {missing}"
        )
    # Bytes that can occur in UTF-8 text must be tokens, or tiktoken cannot encode them.
    utf8_bytes = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]
    missing_bytes = [b for b in utf8_bytes if bytes([b]) not in ranks]
    if missing_bytes:
        raise ValueError(
            f"{source}: byte-level BPE needs every single byte as a token; missing "
            f"{', '.join(hex(b) for b in missing_bytes[:8])}"
        )


def _token_content(value, source: str, what: str) -> str | None:
    """A special-token entry is a string, an AddedToken-like dict, or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    content = getattr(value, "content", None)  # transformers.AddedToken
    if isinstance(content, str):
        return content
    raise ValueError(f"{source}: {what} must be a string or {{'content': ...}}, got {value!r}")


def _read_config(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: tokenizer config not found") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return cfg


def _specials_from_decoder(decoder: Mapping, source: str) -> dict[str, int]:
    specials: dict[str, int] = {}
    for key, value in decoder.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: added_tokens_decoder key {key!r} is not an integer id") from None
        content = _token_content(value, source, f"added_tokens_decoder[{key}]")
        if not content:
            raise ValueError(f"{source}: added_tokens_decoder[{key}] has no content")
        if content in specials and specials[content] != tid:
            raise ValueError(
                f"{source}: special token {content!r} has two ids ({specials[content]} and {tid})"
            )
        specials[content] = tid
    return specials


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the permissions a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _tiktoken_model_bytes(ranks: Mapping[bytes, int]) -> bytes:
    lines = [
        base64.b64encode(tok) + b" " + str(rank).encode()
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return b"\n".join(lines) + b"\n"


def write_tokenizer_files(
    out_dir: str | os.PathLike,
    ranks: Mapping[bytes, int],
    special_tokens: Mapping[str, int],
    *,
    model_max_length: int = MODEL_MAX_LENGTH,
) -> tuple[Path, Path]:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` in the release layout.

    ``ranks``: ``{token bytes: rank}``, ranks 0..N-1 without gaps (e.g. from
    :func:`kimi_mlx.text.bpe.train_bpe`). ``special_tokens``: ``{content: id}``, ids >= N
    (e.g. :func:`kimi_special_tokens` ``(N)``). The config names
    ``tokenizer_class: "TikTokenTokenizer"``, carries ``added_tokens_decoder``,
    ``bos_token`` "[BOS]", ``eos_token`` "<|end_of_msg|>" (the K3 chat end; "[EOS]" if
    absent), ``pad_token``/``unk_token`` when present, ``model_max_length`` and the
    release's ``auto_map`` (which our loader ignores). Each file is written to a temp
    file and renamed into place. Returns the two paths. Raises ``ValueError`` on bad
    ranks or special ids (same checks as :class:`KimiTokenizer`).
    """
    out = Path(out_dir)
    # Validate exactly as a load would, before anything touches the disk.
    KimiTokenizer(dict(ranks), dict(special_tokens), source=str(out))
    out.mkdir(parents=True, exist_ok=True)
    decoder = {
        str(tid): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name, tid in sorted(special_tokens.items(), key=lambda kv: kv[1])
    }
    cfg: dict = {
        "added_tokens_decoder": decoder,
        "auto_map": _RELEASE_AUTO_MAP,
        "bos_token": "[BOS]" if "[BOS]" in special_tokens else None,
        "clean_up_tokenization_spaces": False,
        "eos_token": END_OF_MSG if END_OF_MSG in special_tokens else (
            "[EOS]" if "[EOS]" in special_tokens else None
        ),
        "model_max_length": int(model_max_length),
        "tokenizer_class": "TikTokenTokenizer",
    }
    for key, name in (("pad_token", "[PAD]"), ("unk_token", "[UNK]")):
        if name in special_tokens:
            cfg[key] = name
    model_path = out / TIKTOKEN_FILE
    config_path = out / CONFIG_FILE
    _atomic_write(model_path, _tiktoken_model_bytes(ranks))
    _atomic_write(config_path, (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode())
    # what the auto_map promises: plain transformers (trust_remote_code) loads the folder
    _atomic_write(out / REMOTE_CODE_FILE, REMOTE_CODE_SOURCE.read_bytes())
    return model_path, config_path


# ----------------------------------------------------------------------- tokenizer


class KimiTokenizer:
    """Kimi's byte-level BPE tokenizer on ``tiktoken.Encoding``, built from data only.

    Args:
        mergeable_ranks: ``{token bytes: rank}``, ranks 0..N-1 without gaps; every byte
            that can occur in UTF-8 text must be a single-byte token.
        special_tokens: ``{content: id}``; ids must not collide with ranks. Ids between N
            and the largest special id that no entry names become
            ``<|reserved_token_{id}|>`` (as the release's loader does).
        bos_token, eos_token, pad_token, unk_token: names of special tokens, or None.
            Left out: "[BOS]", "<|end_of_msg|>" (else "[EOS]"), "[PAD]", "[UNK]" when
            present. (Loading from files uses what tokenizer_config.json names.)
        source: file or folder name used in error messages.

    Raises ``ValueError`` (naming ``source``) for rank gaps or duplicates, missing
    single-byte tokens, a special id colliding with a rank, or a named special token
    (bos/eos/...) that is not in ``special_tokens``.

    ``eos_token_ids`` lists ``<|end_of_msg|>`` (the K3 chat end of turn), then
    ``[EOS]``, then the configured ``eos_token``, whichever exist.
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        bos_token: str | None = _AUTO,
        eos_token: str | None = _AUTO,
        pad_token: str | None = _AUTO,
        unk_token: str | None = _AUTO,
        source: str = "<memory>",
    ):
        _check_ranks(mergeable_ranks, source)
        n = len(mergeable_ranks)
        specials = dict(special_tokens)
        for name, tid in specials.items():
            if not isinstance(tid, int) or tid < 0:
                raise ValueError(f"{source}: special token {name!r} has invalid id {tid!r}")
            if tid < n:
                raise ValueError(
                    f"{source}: special token {name!r} id {tid} collides with an ordinary "
                    f"token rank (ranks are 0..{n - 1})"
                )
        by_id: dict[int, str] = {}
        for name, tid in specials.items():
            if tid in by_id:
                raise ValueError(f"{source}: special tokens {by_id[tid]!r} and {name!r} share id {tid}")
            by_id[tid] = name
        if specials:
            for tid in range(n, max(by_id) + 1):
                if tid not in by_id:
                    name = f"<|reserved_token_{tid}|>"
                    if name in specials:
                        raise ValueError(f"{source}: {name!r} is used for id {specials[name]}")
                    specials[name] = tid
                    by_id[tid] = name
        self.source = source
        self.mergeable_ranks = mergeable_ranks
        self.special_tokens: dict[str, int] = dict(sorted(specials.items(), key=lambda kv: kv[1]))
        self.num_base_tokens = n
        self._special_by_id = by_id
        import tiktoken  # here, so `import kimi_mlx` (which registers with transformers) stays cheap

        self.model = tiktoken.Encoding(
            name=Path(source).name or "kimi",
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = n + len(specials)

        if bos_token is _AUTO:
            bos_token = "[BOS]" if "[BOS]" in self.special_tokens else None
        if eos_token is _AUTO:
            eos_token = next((t for t in (END_OF_MSG, "[EOS]") if t in self.special_tokens), None)
        if pad_token is _AUTO:
            pad_token = "[PAD]" if "[PAD]" in self.special_tokens else None
        if unk_token is _AUTO:
            unk_token = "[UNK]" if "[UNK]" in self.special_tokens else None

        def named(name, what):
            if name is None:
                return None
            if name not in self.special_tokens:
                raise ValueError(f"{source}: {what} {name!r} is not a special token")
            return self.special_tokens[name]

        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.bos_token_id = named(bos_token, "bos_token")
        self.pad_token_id = named(pad_token, "pad_token")
        self.unk_token_id = named(unk_token, "unk_token")
        eos_id = named(eos_token, "eos_token")
        eos = [self.special_tokens.get(END_OF_MSG), self.special_tokens.get("[EOS]"), eos_id]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))

    # -- loading

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "KimiTokenizer":
        """Load from a folder holding ``tiktoken.model`` and ``tokenizer_config.json``.

        Reads data only: any ``tokenization_kimi.py`` or ``auto_map`` is ignored.
        Raises ``FileNotFoundError`` naming a missing file and ``ValueError`` naming
        the file (and line, for ``tiktoken.model``) for malformed content.
        """
        folder = Path(folder)
        cfg_path = folder / CONFIG_FILE
        cfg = _read_config(cfg_path)
        return cls.from_files(folder / TIKTOKEN_FILE, cfg, config_source=str(cfg_path))

    @classmethod
    def from_files(
        cls, model_file: str | os.PathLike, config: Mapping, *, config_source: str = CONFIG_FILE
    ) -> "KimiTokenizer":
        """Build from a ``tiktoken.model`` path and an already-parsed tokenizer config.

        ``config`` needs ``added_tokens_decoder`` (``{id: {"content": ...}}``) and may
        name ``bos_token``/``eos_token``/``pad_token``/``unk_token``. Errors as in
        :meth:`from_pretrained`.
        """
        model_file = Path(model_file)
        ranks = _parse_tiktoken_model(model_file)
        decoder = config.get("added_tokens_decoder")
        if not isinstance(decoder, Mapping) or not decoder:
            raise ValueError(f"{config_source}: no added_tokens_decoder with the special tokens")
        specials = _specials_from_decoder(decoder, config_source)
        names = {
            k: _token_content(config.get(k), config_source, k)
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        try:
            return cls(ranks, specials, source=str(model_file.parent), **names)
        except ValueError as e:
            raise ValueError(f"{e} (files: {model_file}, {config_source})") from None

    # -- encoding

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> token ids (``list[int]``).

        With ``allow_special=False`` (the default) special-token text such as
        ``<|open|>`` inside ``text`` is encoded as ordinary text, so user content can
        never forge chat structure. With ``True`` it becomes the special id. A
        :class:`kimi_mlx.text.chat_format.RenderedChat` (``render_chat``'s string) is encoded
        from its segments: its markup gives special ids, its message text stays text.
        """
        if isinstance(text, RenderedChat):
            return encode_segments(self, text.segments)
        if allow_special:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode_ordinary(text)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Token ids -> the raw bytes they stand for (special tokens as their text)."""
        return self.model.decode_bytes(self._check_ids(ids))

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Token ids -> text; invalid UTF-8 (e.g. a cut multi-byte char) is replaced.

        Raises ``ValueError`` for an id outside the vocabulary.
        """
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def token_to_id(self, token: str | bytes) -> int:
        """Id of a special token (str) or of an ordinary token given as bytes, or as str
        (its UTF-8 bytes). Raises ``KeyError`` if there is none."""
        if isinstance(token, str):
            if token in self.special_tokens:
                return self.special_tokens[token]
            token = token.encode("utf-8")
        try:
            return self.mergeable_ranks[token]
        except KeyError:
            raise KeyError(f"no token {token!r}") from None

    def id_to_token(self, token_id: int) -> str | bytes:
        """The special token's text (``str``) or an ordinary token's bytes (``bytes``).
        Raises ``KeyError`` for an id outside the vocabulary."""
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        if 0 <= token_id < self.num_base_tokens:
            return self.model.decode_single_token_bytes(token_id)
        raise KeyError(f"token id {token_id} out of range [0, {self.vocab_size})")

    @property
    def eos_token_id(self) -> int | None:
        """First of :attr:`eos_token_ids` (``<|end_of_msg|>`` for K3 vocabularies)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"KimiTokenizer(source={self.source!r}, ranks={self.num_base_tokens}, "
            f"specials={len(self.special_tokens)})"
        )

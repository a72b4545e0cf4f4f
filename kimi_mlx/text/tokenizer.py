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
the data files alone. :func:`register_with_transformers` makes
``transformers.AutoTokenizer`` (and therefore ``mlx_lm.load``) return our
transformers-compatible ``TikTokenTokenizer`` for such folders, without
``trust_remote_code``.

Importing this module is cheap: tiktoken is imported on first use, transformers never. The
transformers class is built on first access of ``kimi_mlx.text.tokenizer.TikTokenTokenizer``.
"""

from __future__ import annotations

import base64
import binascii
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, Mapping

from kimi_mlx.text.chat_format import MARKERS, RenderedChat, encode_segments

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

# Written into tokenizer_config.json like the release does; our loader never follows it.
_RELEASE_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}


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


# ---------------------------------------------------------------- transformers glue


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map (how byte-level BPE tokens are
    spelled as strings in transformers vocabularies)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _build_hf_class():
    from transformers import AddedToken, BatchEncoding, PreTrainedTokenizer

    byte_encoder = _bytes_to_unicode()
    byte_decoder = {c: b for b, c in byte_encoder.items()}

    class TikTokenTokenizer(PreTrainedTokenizer):
        """transformers tokenizer for Kimi checkpoints, wrapping :class:`KimiTokenizer`.

        Named like the class in the release's ``tokenizer_config.json``
        (``tokenizer_class: "TikTokenTokenizer"``) so ``AutoTokenizer`` picks it after
        :func:`register_with_transformers`; the release's ``tokenization_kimi.py`` is
        never run. Ordinary tokens are spelled in GPT-2 byte-to-unicode form, specials
        as their text.

        Special tokens and text (unlike transformers' default, and unlike the release's
        tokenizer): ``encode``/``__call__``/``tokenize`` treat special-token text such
        as ``<|open|>`` as ordinary text, so user text can never become chat structure
        on any path that encodes a string (``split_special_tokens`` defaults to True).
        A caller asks for specials explicitly with ``split_special_tokens=False`` (per
        call, or at load time). Two inputs keep their structure anyway:

        * the string :meth:`apply_chat_template` returns with ``tokenize=False`` (a
          :class:`~kimi_mlx.text.chat_format.RenderedChat`), which encodes to exactly
          the ids of ``tokenize=True``: mlx_lm.generate renders, then encodes;
        * a string that is exactly one chat marker (``<|open|>think<|sep|>``, a single
          structure token, ...: ``chat_format.MARKERS``), which mlx-lm's
          ``TokenizerWrapper`` looks up to find reasoning and tool-call sections in
          token ids. Such a string is a whole input, never text inside a chat.
        """

        vocab_files_names = {"vocab_file": TIKTOKEN_FILE}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(
            self,
            vocab_file,
            bos_token="[BOS]",
            eos_token="[EOS]",
            unk_token=None,
            pad_token=None,
            added_tokens_decoder=None,
            **kwargs,
        ):
            vocab_file = Path(vocab_file)
            if added_tokens_decoder:
                config = {"added_tokens_decoder": added_tokens_decoder}
                source = f"added_tokens_decoder for {vocab_file}"
            else:
                source = str(vocab_file.parent / CONFIG_FILE)
                config = _read_config(vocab_file.parent / CONFIG_FILE)
            config = dict(config)
            for key, value in (
                ("bos_token", bos_token),
                ("eos_token", eos_token),
                ("unk_token", unk_token),
                ("pad_token", pad_token),
            ):
                config[key] = _token_content(value, source, key)
            self.kimi = KimiTokenizer.from_files(vocab_file, config, config_source=source)
            self.vocab_file = str(vocab_file)
            self._id_to_str = [
                "".join(byte_encoder[b] for b in self.kimi.model.decode_single_token_bytes(i))
                for i in range(self.kimi.num_base_tokens)
            ]
            self._vocab = {s: i for i, s in enumerate(self._id_to_str)}
            self._vocab.update(self.kimi.special_tokens)
            decoder = {
                tid: AddedToken(name, special=True, normalized=False)
                for name, tid in self.kimi.special_tokens.items()
            }
            kwargs.setdefault("clean_up_tokenization_spaces", False)
            kwargs.setdefault("split_special_tokens", True)  # see the class docstring
            kwargs.setdefault("special_tokens_pattern", "none")
            kwargs.setdefault("model_max_length", MODEL_MAX_LENGTH)
            super().__init__(
                bos_token=config["bos_token"],
                eos_token=config["eos_token"],
                unk_token=config["unk_token"],
                pad_token=config["pad_token"],
                added_tokens_decoder=decoder,
                **kwargs,
            )

        # -- vocabulary

        @property
        def vocab_size(self) -> int:
            return self.kimi.vocab_size

        def get_vocab(self) -> dict[str, int]:
            return dict(self._vocab)

        @property
        def eos_token_ids(self) -> list[int]:
            """End-of-turn ids for generation (``<|end_of_msg|>``, ``[EOS]``)."""
            return list(self.kimi.eos_token_ids)

        def _convert_token_to_id(self, token: str):
            return self._vocab.get(token, self.kimi.unk_token_id)

        def _convert_id_to_token(self, index: int) -> str:
            if 0 <= index < self.kimi.num_base_tokens:
                return self._id_to_str[index]
            return self.kimi._special_by_id.get(index, self.unk_token)

        # -- encoding

        def tokenize(self, text: str, **kwargs) -> list[str]:
            split_special = kwargs.pop("split_special_tokens", self.split_special_tokens)
            if isinstance(text, RenderedChat):
                return [self._convert_id_to_token(i) for i in encode_segments(self.kimi, text.segments)]
            if text in MARKERS and text:
                split_special = False
            if len(self._added_tokens_encoder) > len(self.kimi.special_tokens):
                # Someone added tokens through transformers: let its trie handle them.
                return super().tokenize(text, split_special_tokens=split_special, **kwargs)
            ids = self.kimi.encode(text, allow_special=not split_special)
            return [self._convert_id_to_token(i) for i in ids]

        def _tokenize(self, text: str, **kwargs) -> list[str]:
            return [self._id_to_str[i] for i in self.kimi.encode(text)]

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            out = bytearray()
            for tok in tokens:
                if tok in self.kimi.special_tokens or tok in self._added_tokens_encoder:
                    out += tok.encode("utf-8")
                else:
                    out += bytes(byte_decoder[c] for c in tok)
            return out.decode("utf-8", errors="replace")

        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
            if isinstance(token_ids, int):
                token_ids = [token_ids]
            ids = [int(i) for i in token_ids]
            if skip_special_tokens:
                ids = [i for i in ids if i < self.kimi.num_base_tokens]
            if all(0 <= i < self.kimi.vocab_size for i in ids):
                return self.kimi.decode(ids)
            return super()._decode(ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)

        def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
            # Kimi adds no BOS/EOS around plain text; the chat encoding does the framing.
            return list(token_ids_0) + list(token_ids_1 or [])

        def save_vocabulary(self, save_directory, filename_prefix=None):
            name = (filename_prefix + "-" if filename_prefix else "") + TIKTOKEN_FILE
            path = Path(save_directory) / name
            _atomic_write(path, _tiktoken_model_bytes(self.kimi.mergeable_ranks))
            return (str(path),)

        # -- chat

        def apply_chat_template(
            self,
            conversation,
            tools=None,
            add_generation_prompt: bool = False,
            tokenize: bool = True,
            return_dict: bool = False,
            return_tensors=None,
            reasoning_effort: str | None = None,
            thinking_effort: str | None = None,
            continue_final_message: bool = False,
            tool_choice=None,
            response_format=None,
            **kwargs,
        ):
            """Render or encode messages with the K3.1 chat encoding (kimi_mlx.text.chat_format).

            ``conversation``: list of message dicts (or a batch: list of such lists).
            ``reasoning_effort``/``thinking_effort``: "low" | "high" | "max" (default
            "max"). ``tool_choice``/``response_format`` as in ``chat_format.chat_segments``.
            Other transformers kwargs (``enable_thinking``, ``chat_template``,
            ``padding``, ``sanitize_control_tokens``...) are accepted and ignored: K3.1
            always thinks, and message text is never turned into control tokens.
            Returns a ``str`` (tokenize=False: a ``RenderedChat``, whose ``encode`` gives
            the tokenize=True ids), ``list[int]``, or a ``BatchEncoding``
            (return_dict=True). Raises ``ValueError`` for an unknown effort or role and
            ``NotImplementedError`` for ``continue_final_message``.
            """
            from kimi_mlx.text import chat_format

            if continue_final_message:
                raise NotImplementedError("continue_final_message is not supported for Kimi K3.1")
            effort = chat_format.resolve_effort(reasoning_effort, thinking_effort)
            batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
            convs = conversation if batched else [conversation]
            convs = [c["messages"] if isinstance(c, Mapping) else c for c in convs]
            options = {"tool_choice": tool_choice, "response_format": response_format}
            if not tokenize:
                out = [
                    chat_format.render_chat(c, effort, add_generation_prompt, tools, **options)
                    for c in convs
                ]
                return out if batched else out[0]
            ids = [
                chat_format.encode_chat(self.kimi, c, effort, add_generation_prompt, tools, **options)
                for c in convs
            ]
            if return_dict:
                data = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}
                if not batched:
                    data = {k: v[0] for k, v in data.items()}
                return BatchEncoding(data, tensor_type=return_tensors)
            return ids if batched else ids[0]

    TikTokenTokenizer.__module__ = __name__
    TikTokenTokenizer.__qualname__ = "TikTokenTokenizer"
    return TikTokenTokenizer


_HF_CLASS = None


def _hf_class():
    global _HF_CLASS
    if _HF_CLASS is None:
        _HF_CLASS = _build_hf_class()
    return _HF_CLASS


def __getattr__(name):
    # The transformers class is built lazily so `import kimi_mlx.text.tokenizer` stays cheap.
    if name == "TikTokenTokenizer":
        return _hf_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TOKENIZATION_AUTO = "transformers.models.auto.tokenization_auto"
_REGISTERED = False
# Top-level model_type values of Kimi K3/K3.1 checkpoints. Registering a config class for
# them means AutoConfig never offers to run the checkpoint's configuration_*.py.
_MODEL_TYPES = ("kimi_k31", "kimi_k3")


def _register_now() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = _hf_class()
    for model_type in _MODEL_TYPES:
        if model_type not in CONFIG_MAPPING:
            name = "".join(p.capitalize() for p in model_type.split("_")) + "Config"
            config_cls = type(name, (PretrainedConfig,), {"model_type": model_type, "__module__": __name__})
            AutoConfig.register(model_type, config_cls, exist_ok=True)
    # AutoTokenizer.register is what makes the name "TikTokenTokenizer" resolve to our
    # class. It is keyed on a config class that AutoConfig never returns on purpose: when
    # a folder's config type is *in* the tokenizer mapping, transformers runs the folder's
    # auto_map code under trust_remote_code=True; when it is not, our class always wins.
    marker = type("_KimiTikTokenMarkerConfig", (PretrainedConfig,), {"model_type": "", "__module__": __name__})
    AutoTokenizer.register(marker, tokenizer_class=cls, exist_ok=True)
    _REGISTERED = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """One-shot finder: registers our tokenizer right after transformers' AutoTokenizer
    module is executed, so `import kimi_mlx` does not pay for importing transformers."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TOKENIZATION_AUTO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _register_now()
        except Exception as e:  # never break transformers itself
            warnings.warn(f"kimi_mlx: could not register TikTokenTokenizer with transformers: {e}")


def register_with_transformers(lazy: bool = True) -> None:
    """Make ``AutoTokenizer.from_pretrained(folder)`` return our ``TikTokenTokenizer``.

    Applies to folders whose ``tokenizer_config.json`` says
    ``"tokenizer_class": "TikTokenTokenizer"``, even with an ``auto_map`` pointing at
    ``tokenization_kimi.py``: no ``trust_remote_code`` is needed and no file from the
    folder is executed. Also registers minimal ``AutoConfig`` types ``kimi_k31`` and
    ``kimi_k3`` (unless transformers already knows them), so AutoConfig does not prompt
    to run the checkpoint's configuration code. ``mlx_lm.load`` goes through
    AutoTokenizer, so it picks this up too.

    With ``lazy=True`` (default) and transformers' tokenizer module not yet imported,
    registration is deferred to that import (no transformers import cost now).
    Idempotent.
    """
    if _REGISTERED:
        return
    if lazy and _TOKENIZATION_AUTO not in sys.modules:
        if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
        return
    _register_now()

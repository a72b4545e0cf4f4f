"""Kimi K3/K3.1 tokenizer for plain ``transformers``: the ``tokenization_kimi.py`` that a
checkpoint folder's ``tokenizer_config.json`` names in its ``auto_map``
(``"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]``).

Self-contained on purpose: it is copied into every checkpoint folder we write
(``kimi_mlx.text.tokenizer.write_tokenizer_files``) and loaded by
``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` in a Python where
``kimi_mlx`` is not installed (lm-evaluation-harness's HF tokenizer, a plain transformers
script). It imports only the standard library, ``tiktoken`` and ``transformers``.
Where ``kimi_mlx`` is importable, ``kimi_mlx.text.hf_register`` gives AutoTokenizer our
``kimi_mlx.text.hf_tokenizer.TikTokenTokenizer`` instead and this file is never run.

Same token ids as ``kimi_mlx.text.tokenizer.KimiTokenizer``: the ranks of
``tiktoken.model`` (``base64(token bytes) SPACE rank`` lines), the K2/K3 pre-tokenizer
regex, the special tokens of ``added_tokens_decoder`` (ids between them that no entry
names are ``<|reserved_token_{id}|>``). Special-token text inside a string is encoded as
ordinary text (``split_special_tokens=True``, the default), so user text never becomes a
control token; pass ``split_special_tokens=False`` (per call or at load) to get the
special ids. No BOS/EOS is added around text.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

__all__ = ["TikTokenTokenizer"]

VOCAB_FILE = "tiktoken.model"

# The K2/K3 pre-tokenizer (tiktoken's Rust regex engine accepts the `&&` intersection).
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def _byte_spelling() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map: how byte-level tokens are
    spelled as strings in a transformers vocabulary."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_SPELL = _byte_spelling()
_UNSPELL = {c: b for b, c in _SPELL.items()}


def _read_ranks(path: str) -> Dict[bytes, int]:
    """``base64 rank`` lines -> {token bytes: rank}; ValueError naming the file and line."""
    ranks: Dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (IndexError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: expected 'base64 rank' ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _content(value) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("content")
    return getattr(value, "content", None)  # AddedToken


class TikTokenTokenizer(PreTrainedTokenizer):
    """transformers tokenizer of a Kimi checkpoint folder (tiktoken byte-level BPE).

    Args:
        vocab_file: the folder's ``tiktoken.model``.
        bos_token, eos_token, unk_token, pad_token: special tokens by name (from
            ``tokenizer_config.json``).
        added_tokens_decoder: ``{id: AddedToken or {"content": ...}}``, the special
            tokens; read from the ``tokenizer_config.json`` beside ``vocab_file`` when
            not given.
    Raises:
        ValueError: malformed ``tiktoken.model``, a special id inside the ranks, or no
            special tokens at all.
    """

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
                 pad_token=None, added_tokens_decoder=None, **kwargs):
        self.vocab_file = str(vocab_file)
        ranks = _read_ranks(self.vocab_file)
        decoder = added_tokens_decoder
        if not decoder:
            cfg = os.path.join(os.path.dirname(self.vocab_file), "tokenizer_config.json")
            with open(cfg, encoding="utf-8") as f:
                decoder = json.load(f).get("added_tokens_decoder") or {}
        specials = {_content(v): int(k) for k, v in decoder.items()}
        if not specials:
            raise ValueError(f"{self.vocab_file}: no special tokens (added_tokens_decoder)")
        n = len(ranks)
        by_id = {i: s for s, i in specials.items()}
        if min(by_id) < n:
            raise ValueError(f"{self.vocab_file}: special token id {min(by_id)} is inside "
                             f"the ranks 0..{n - 1}")
        for i in range(n, max(by_id) + 1):
            if i not in by_id:
                by_id[i] = f"<|reserved_token_{i}|>"
        self.special_ids = {s: i for i, s in sorted(by_id.items())}
        self.num_base_tokens = n
        self.model = tiktoken.Encoding(name=os.path.basename(os.path.dirname(self.vocab_file)) or "kimi",
                                       pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_ids)
        self._by_id = by_id
        self._spelled = ["".join(_SPELL[b] for b in self.model.decode_single_token_bytes(i))
                         for i in range(n)]
        self._vocab = {s: i for i, s in enumerate(self._spelled)}
        self._vocab.update(self.special_ids)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("model_max_length", 1048576)
        super().__init__(
            bos_token=_content(bos_token), eos_token=_content(eos_token),
            unk_token=_content(unk_token), pad_token=_content(pad_token),
            added_tokens_decoder={i: AddedToken(s, special=True, normalized=False)
                                  for i, s in by_id.items()},
            **kwargs)

    # -- vocabulary

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + len(self.special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> Dict[str, int]:
        return dict(self._vocab)

    def _convert_token_to_id(self, token: str):
        return self._vocab.get(token, self.special_ids.get(self.unk_token) if self.unk_token else None)

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < self.num_base_tokens:
            return self._spelled[index]
        return self._by_id.get(index, self.unk_token)

    # -- text -> tokens

    def tokenize(self, text: str, **kwargs) -> List[str]:
        split = kwargs.pop("split_special_tokens", self.split_special_tokens)
        if split:
            ids = self.model.encode_ordinary(text)
        else:
            ids = self.model.encode(text, allowed_special="all")
        return [self._convert_id_to_token(i) for i in ids]

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return [self._spelled[i] for i in self.model.encode_ordinary(text)]

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        out = bytearray()
        for tok in tokens:
            if tok in self.special_ids:
                out += tok.encode("utf-8")
            else:
                out += bytes(_UNSPELL[c] for c in tok)
        return out.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        # Kimi adds no BOS/EOS around plain text
        return list(token_ids_0) + list(token_ids_1 or [])

    # -- ids -> text

    def _decode(self, token_ids, skip_special_tokens: bool = False,
                clean_up_tokenization_spaces=None, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(i) for i in token_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_base_tokens]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is not in the vocabulary [0, {self.vocab_size})")
        return self.model.decode_bytes(ids).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE
        path = os.path.join(save_directory, name)
        with open(path, "wb") as f:
            for i in range(self.num_base_tokens):
                f.write(base64.b64encode(self.model.decode_single_token_bytes(i)) + b" " + str(i).encode() + b"\n")
        return (path,)

"""``TikTokenTokenizer``: a transformers ``PreTrainedTokenizer`` over
:class:`~kimi_mlx.text.tokenizer.KimiTokenizer`, for ``AutoTokenizer`` and so
``mlx_lm.load``.

This module imports transformers; ``kimi_mlx.text.hf_register`` imports it only once
transformers itself is imported, so ``import kimi_mlx`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from transformers import AddedToken, BatchEncoding, PreTrainedTokenizer

from kimi_mlx.text.chat_format import MARKERS, RenderedChat, encode_segments
from kimi_mlx.text.tokenizer import (CONFIG_FILE, MODEL_MAX_LENGTH, TIKTOKEN_FILE, KimiTokenizer, _atomic_write,
                                     _read_config, _tiktoken_model_bytes, _token_content)

__all__ = ["TikTokenTokenizer"]


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


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


class TikTokenTokenizer(PreTrainedTokenizer):
    """transformers tokenizer for Kimi checkpoints, wrapping :class:`KimiTokenizer`.

    Named like the class in the release's ``tokenizer_config.json``
    (``tokenizer_class: "TikTokenTokenizer"``) so ``AutoTokenizer`` picks it after
    :func:`kimi_mlx.text.hf_register.register_with_transformers`; the release's ``tokenization_kimi.py`` is
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
            "".join(_BYTE_ENCODER[b] for b in self.kimi.model.decode_single_token_bytes(i))
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
                out += bytes(_BYTE_DECODER[c] for c in tok)
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

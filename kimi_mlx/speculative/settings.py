"""What a command asks speculative decoding for (`DraftSettings`), as a small typed
object made once from the flags (`generation.request.draft_settings`); the one factory
(`speculative.factory.build_speculation`) turns it into a `Speculation`.

No MLX here: the command layer reads the defaults without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from kimi_mlx.speculative.auto_k import parse_num_draft_tokens

__all__ = ["DEFAULT_NUM_DRAFT_TOKENS", "DEFAULT_NGRAM_MAX", "DEFAULT_NGRAM_MIN", "DRAFT_KINDS",
           "DraftSettings"]

DEFAULT_NUM_DRAFT_TOKENS = 3  # k, drafts per verify step (mlx-lm's --num-draft-tokens default)
DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN = 4, 1  # --draft ngram's n-gram sizes
DRAFT_KINDS = ("mtp", "ngram")  # --draft KIND: drafts without a separate draft model


@dataclass(frozen=True)
class DraftSettings:
    """One kind of draft and its settings.

    model: a draft checkpoint (`--draft-model`: a kimi-mlx checkpoint, an mlx-lm model
    with the target's tokenizer, or a DFlash / DSpark block drafter folder), or None.
    kind: "mtp" (the target checkpoint's own MTP layers) or "ngram" (prompt lookup), or
    None with a model. num_draft_tokens: k >= 1, or "auto" / "auto:N" (k chosen per step
    up to N, `kimi_mlx.speculative.auto_k`).
    ngram_max / ngram_min: `--draft ngram`'s sizes, 1 <= min <= max.
    Raises:
        ValueError: neither or both of model and kind, an unknown kind, k < 1, or n-gram
            sizes out of order (each naming the flag).
    """

    model: Optional[str] = None
    kind: Optional[str] = None
    num_draft_tokens: Union[int, str] = DEFAULT_NUM_DRAFT_TOKENS
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN

    def __post_init__(self):
        if bool(self.model) == bool(self.kind):
            raise ValueError("give --draft-model or --draft, exactly one")
        if self.kind is not None and self.kind not in DRAFT_KINDS:
            raise ValueError(f"--draft must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        # an int >= 1 or "auto[:N]" (ValueError naming --num-draft-tokens otherwise)
        object.__setattr__(self, "num_draft_tokens", parse_num_draft_tokens(self.num_draft_tokens))
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got "
                             f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}")

    @property
    def flag(self) -> str:
        """How the user asked for it: "--draft-model" or "--draft KIND"."""
        return "--draft-model" if self.model else f"--draft {self.kind}"

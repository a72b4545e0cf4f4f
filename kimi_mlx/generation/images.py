"""Images in a request: decode and preprocess them, put them in the messages, run the
vision tower (loaded on the first request that has images), and build the prompt's
input embeddings with the `<|media_pad|>` rows replaced.

Every front end goes through here: `kimi-mlx generate --image`, `chat`'s `/image`, and
the servers (which decode `image_url` data URLs / Anthropic base64 blocks to bytes and
call `load_image` on them). A text-only request never touches the vision tower.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Union

from kimi_mlx.generation.request import InputError
from kimi_mlx.vision.config import MediaProcArgs
from kimi_mlx.vision.preprocess import MAX_PIXELS, ImageError, ProcessedImage, load_and_preprocess

MEDIA_PAD = "<|media_pad|>"


def image_part(image: ProcessedImage) -> dict:
    """A resolved content part (`chat_format` renders it as the image's media block)."""
    return {"type": "image", "media": image}


class Vision:
    """A checkpoint's image input: its processor settings now, its tower on first use.

    `Vision(model_dir)` reads only `preprocessor_config.json`; `features()` loads the
    tower and projector (`checkpoint.loader.load_vision`) the first time an image needs
    them. `available` says whether the checkpoint has vision weights at all.
    """

    def __init__(self, model_dir, max_pixels: int = MAX_PIXELS):
        self.model_dir = Path(model_dir)
        self.media = MediaProcArgs.from_dir(self.model_dir)
        self.max_pixels = max_pixels
        self._model = None

    @property
    def available(self) -> bool:
        from kimi_mlx.checkpoint.loader import has_vision

        return has_vision(self.model_dir)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self):
        """The `VisionModel` (loaded on first use). CheckpointError (a ValueError) when the
        checkpoint has no vision weights, naming it."""
        if self._model is None:
            from kimi_mlx.checkpoint.loader import load_vision

            self._model = load_vision(self.model_dir)
        return self._model

    def load_image(self, source: Union[str, Path, bytes], name: Optional[str] = None) -> ProcessedImage:
        """Decode + preprocess one image (a path or encoded bytes). InputError naming it
        for an unreadable, unsupported or oversized image."""
        try:
            return load_and_preprocess(source, self.media, self.max_pixels, name)
        except ImageError as e:
            raise InputError(str(e)) from None

    def features(self, images: Sequence[ProcessedImage]):
        """Projector rows [sum num_tokens, text hidden] of `images`, in order."""
        import mlx.core as mx
        import numpy as np

        model = self.model
        patches = mx.array(np.concatenate([im.patches for im in images]))
        out = model(patches, [im.grid for im in images])
        if sum(im.num_tokens for im in images) != out.shape[0]:
            raise ValueError(f"the vision tower gave {out.shape[0]} rows for images of "
                             f"{[im.num_tokens for im in images]} tokens")
        return out


def media_pad_id(tokenizer, config: Optional[Mapping[str, Any]] = None) -> int:
    """`<|media_pad|>`'s id from the tokenizer (the id the prompt is built with), checked
    against config.json's `media_placeholder_token_id` (a warning when they disagree, as
    they have been seen to; the tokenizer's id is used). InputError when the vocabulary
    has no such token."""
    tok = getattr(tokenizer, "kimi", tokenizer)
    pad = tok.special_tokens.get(MEDIA_PAD)
    if pad is None:
        raise InputError(f"the tokenizer has no {MEDIA_PAD} token: this checkpoint cannot take images")
    cfg = (config or {}).get("media_placeholder_token_id")
    if cfg is not None and cfg != pad:
        warnings.warn(f"config.json media_placeholder_token_id {cfg} != the tokenizer's "
                      f"{MEDIA_PAD} id {pad}; using the tokenizer's", stacklevel=2)
    return pad


def prompt_embeddings(model, vision: Vision, ids: List[int], images: Sequence[ProcessedImage],
                      pad_id: int):
    """Input embeddings [L, hidden] of prompt `ids` whose pads are the images' rows
    (`Model.embed_with_media`), or None when there are no images."""
    if not images:
        return None
    import mlx.core as mx

    feats = vision.features(images)
    try:
        return model.embed_with_media(mx.array(ids), feats, pad_id)
    except ValueError as e:
        raise InputError(str(e)) from None


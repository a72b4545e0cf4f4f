"""Images in a request: decode and preprocess them, put them in the messages, run the
vision tower (loaded on the first request that has images), and build the prompt's
input embeddings with the `<|media_pad|>` rows replaced.

Every front end goes through here: `kimi-mlx generate --image`, `chat`'s `/image`, and
the servers (which decode `image_url` data URLs / Anthropic base64 blocks to bytes and
call `load_image` on them). A text-only request never touches the vision tower.

The tower's rows of each image are kept by the image's digest (`TowerCache`: bounded in
bytes, least recently used dropped first), so a new turn of a conversation with images,
or a prompt-cache hit that ends inside or after an image, never runs the tower again
over an image it already ran on; `Vision.stats()` counts the runs (the servers export
them on /metrics).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Union

from kimi_mlx.generation.request import InputError
from kimi_mlx.vision.config import MediaProcArgs
from kimi_mlx.vision.preprocess import (MAX_PIXELS, ImageError, ProcessedImage, image_size,
                                        load_and_preprocess, token_count)

MEDIA_PAD = "<|media_pad|>"
# bytes of tower rows kept per checkpoint (`TowerCache`): at K3.1 size (hidden 7168,
# float32 on the CPU backend) one 1024-token image is 29 MB, a 4096-token one 117 MB
TOWER_CACHE_BYTES = 512 << 20


def image_part(image: ProcessedImage) -> dict:
    """A resolved content part (`chat_format` renders it as the image's media block)."""
    return {"type": "image", "media": image}


class TowerCache:
    """The tower's rows of images, by image key, bounded in bytes (least recently used
    dropped first). Not thread-safe by itself: `Vision` holds its lock around it.

    Args:
        max_bytes: bytes of rows kept at most (0: nothing kept); an image whose rows
            alone exceed it is not kept.
    """

    def __init__(self, max_bytes: int = TOWER_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"the tower cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: "OrderedDict[tuple, object]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key) -> bool:
        return key in self._rows

    def get(self, key):
        """The rows stored under `key` (now the most recently used), or None."""
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
        return rows

    def put(self, key, rows) -> None:
        """Keep `rows` (an evaluated mx.array) under `key`, dropping the least recently
        used entries until they fit; rows larger than the whole budget are not kept."""
        n = rows.nbytes
        if n > self.max_bytes or key in self._rows:
            return
        while self.bytes + n > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self.bytes -= old.nbytes
        self._rows[key] = rows
        self.bytes += n


class Vision:
    """A checkpoint's image input: its processor settings now, its tower on first use.

    `Vision(model_dir)` reads only `preprocessor_config.json`; `features()` loads the
    tower and projector (`checkpoint.loader.load_vision`) the first time an image needs
    them. `available` says whether the checkpoint has vision weights at all.
    `cache_bytes`: the `TowerCache` budget (rows kept by image digest across requests).
    Thread-safe: the tower runs and the cache is read under one lock.
    """

    def __init__(self, model_dir, max_pixels: int = MAX_PIXELS,
                 cache_bytes: int = TOWER_CACHE_BYTES):
        self.model_dir = Path(model_dir)
        self.media = MediaProcArgs.from_dir(self.model_dir)
        self.max_pixels = max_pixels
        self._model = None
        self.cache = TowerCache(cache_bytes)
        self.tower_runs = 0  # images the tower ran on (each run is one image)
        self.cache_hits = 0  # images whose rows came from `cache`
        self._lock = threading.RLock()

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

    def image_size(self, source: Union[str, Path, bytes], name: Optional[str] = None):
        """(width, height) of one encoded image from its header, nothing decoded
        (`vision.preprocess.image_size`). InputError naming it as `load_image`."""
        try:
            return image_size(source, self.max_pixels, name)
        except ImageError as e:
            raise InputError(str(e)) from None

    def token_count(self, width: int, height: int) -> int:
        """`<|media_pad|>` tokens of a width x height image under this checkpoint's
        processor settings (what `load_image(...).num_tokens` will be)."""
        return token_count(width, height, self.media)

    def stats(self) -> dict:
        """{"tower_runs": images the tower ran on, "cache_hits": images whose rows came
        from the cache, "cache_bytes": bytes of rows kept, "cache_images": images kept}."""
        with self._lock:
            return {"tower_runs": self.tower_runs, "cache_hits": self.cache_hits,
                    "cache_bytes": self.cache.bytes, "cache_images": len(self.cache)}

    @staticmethod
    def _key(image: ProcessedImage):
        return (image.digest, tuple(image.grid)) if image.digest else None

    def has_rows(self, image: ProcessedImage) -> bool:
        """Whether the cache holds this image's rows (`image_rows` would not run the tower)."""
        key = self._key(image)
        with self._lock:
            return key is not None and key in self.cache

    def image_rows(self, image: ProcessedImage):
        """Projector rows [image.num_tokens, text hidden] of one image, evaluated: from
        the cache when this image (its digest and grid) ran before, else one tower run
        (then cached). An image without a digest (built by hand, not by `load_image`) is
        never cached. ValueError when the tower's row count is not the image's."""
        import mlx.core as mx

        key = self._key(image)
        with self._lock:
            rows = self.cache.get(key) if key is not None else None
            if rows is not None:
                self.cache_hits += 1
                return rows
            # one image per run: the rows of an image do not depend on what else is in
            # the request, so cached rows are bit for bit what a fresh run would give
            rows = self.model(mx.array(image.patches), [tuple(image.grid)])
            mx.eval(rows)
            self.tower_runs += 1
            if rows.shape[0] != image.num_tokens:
                raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image "
                                 f"of {image.num_tokens} tokens ({image.source})")
            if key is not None:
                self.cache.put(key, rows)
            return rows

    def features(self, images: Sequence[ProcessedImage]):
        """Projector rows [sum num_tokens, text hidden] of `images`, in order (each
        image's rows by `image_rows`: the tower runs only on images not cached)."""
        import mlx.core as mx

        if not images:
            raise ValueError("features() needs at least one image")
        rows = [self.image_rows(im) for im in images]
        return rows[0] if len(rows) == 1 else mx.concatenate(rows)

    @staticmethod
    def images_from(ids: Sequence[int], images: Sequence[ProcessedImage], pad_id: int,
                    start: int) -> List[ProcessedImage]:
        """The images (in order) with a `<|media_pad|>` at or after position `start` of
        `ids` (their pads in prompt order, each image's num_tokens of them)."""
        skip = sum(1 for t in ids[:start] if t == pad_id)
        out, seen = [], 0
        for im in images:
            if seen + im.num_tokens > skip:
                out.append(im)
            seen += im.num_tokens
        return out

    def rows_from(self, ids: Sequence[int], images: Sequence[ProcessedImage], pad_id: int,
                  start: int):
        """Rows [pads in ids[start:], hidden] for the `<|media_pad|>` positions at or
        after `start` (the prompt before it is cached): the tower runs only on images with
        a pad there (an image that straddles `start` gives its rows past it), or None when
        no pad is at or after `start`.

        Args:
            ids: the prompt's token ids; images: its images in prompt order, whose
                num_tokens add up to the pads in `ids`.
        Raises:
            ValueError: the pads do not add up to the images' tokens (naming both).
        """
        total = sum(1 for t in ids if t == pad_id)
        if total != sum(im.num_tokens for im in images):
            raise ValueError(f"the prompt has {total} <|media_pad|> tokens (id {pad_id}) "
                             f"but its images take {sum(im.num_tokens for im in images)}")
        skip = sum(1 for t in ids[:start] if t == pad_id)
        if skip == total:
            return None
        import mlx.core as mx

        parts, seen = [], 0
        for im in images:
            if seen + im.num_tokens > skip:
                rows = self.image_rows(im)
                parts.append(rows[max(0, skip - seen):])
            seen += im.num_tokens
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)


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


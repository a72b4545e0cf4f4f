"""Image preprocessing exactly as K3's released processor (`kimi_k3_vision_processing.py`,
`media_utils.py`; K31_SPEC.md section 7), with Pillow for decoding and resizing.

For an image of W x H pixels (`MediaProcArgs`, defaults patch p = 14, merge 2 x 2,
in_patch_limit 65536, patch_limit_on_one_side 512, mean = std = 0.5):

1. scale = min(1, sqrt(in_patch_limit / (max(1, W // p) * max(1, H // p))),
   512 p / W, 512 p / H) (never upscales); new size = min(max(1, int(side * scale)), 512 p).
2. Pillow BICUBIC resize to the new size (a palette image is first made RGBA; an image
   with alpha is resized as RGBA, which Pillow does premultiplied).
3. An image with alpha (an A band, or a palette / grey image with a transparent colour)
   is composited onto a chessboard of 8-px squares, white (255) at the top-left, grey
   (180) beside it: out = a * rgb + (1 - a) * bg in float32 with a = alpha / 255,
   truncated to uint8 (numpy `astype`, as the release). Others are converted to RGB.
4. Zero (black) padding at the bottom and right up to multiples of p * merge (28).
5. x = (v / 255 - mean) / std as float32, so padding is -1.0; patchify to
   (H/p * W/p, 3, p, p), patches row-major, each channel-first; grid (H/p, W/p).
   The image becomes H/p * W/p / 4 tokens.

Bounded work: the header is read first and an image of more than `max_pixels`
(default 20000 x 20000) is refused as a possible decompression bomb before any pixel is
decoded; `image_size` reads only the header, so a caller can size a request's images
(pixels, `token_count`) and refuse them before decoding any; anything accepted is resized to at most 512 x 512 patches before it is
patchified. Decoding takes PNG, JPEG, WebP and GIF (its first frame); EXIF orientation
is not applied (the release does not). Errors are `ImageError`, naming the image.
"""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple, Union

import numpy as np

from kimi_mlx.vision.config import MediaProcArgs

__all__ = ["ImageError", "ProcessedImage", "FORMATS", "MAX_PIXELS", "resize_plan", "open_image",
           "image_size", "preprocess", "load_and_preprocess", "token_count"]

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 20000 * 20000
_PIL_LOCK = threading.Lock()


class ImageError(ValueError):
    """An image that cannot be used: unreadable, unsupported format, or too large."""


@dataclass
class ProcessedImage:
    """One preprocessed image.

    patches: float32 [grid_h * grid_w, 3, p, p]; grid: (grid_h, grid_w) in patches;
    width, height: the original size (the prompt's `image WxH`); num_tokens: rows of the
    projector output = `<|media_pad|>` positions; source: name for messages; digest:
    SHA-256 of the encoded bytes (for caches keyed on the image)."""

    patches: np.ndarray
    grid: Tuple[int, int]
    width: int
    height: int
    num_tokens: int
    source: str = "image"
    digest: str = ""


def resize_plan(width: int, height: int, cfg: MediaProcArgs = MediaProcArgs()) -> Tuple[int, int, int, int]:
    """(new_w, new_h, pad_w, pad_h) of the release's rule (module docstring, steps 1 and 4).

    Raises ImageError for a non-positive size."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image size {width}x{height} is empty")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    fh, fw = cfg.merge_kernel_size[0] * p, cfg.merge_kernel_size[1] * p
    return new_w, new_h, (fw - new_w % fw) % fw, (fh - new_h % fh) % fh


def token_count(width: int, height: int, cfg: MediaProcArgs = MediaProcArgs()) -> int:
    """`<|media_pad|>` tokens of a W x H image (without decoding it)."""
    new_w, new_h, pad_w, pad_h = resize_plan(width, height, cfg)
    p = cfg.patch_size
    kh, kw = cfg.merge_kernel_size
    return ((new_h + pad_h) // p // kh) * ((new_w + pad_w) // p // kw)


def _read(source: Union[str, Path, bytes], name: str = None) -> Tuple[str, bytes]:
    if isinstance(source, (str, Path)):
        name = name or str(source)
        try:
            return name, Path(source).read_bytes()
        except OSError as e:
            raise ImageError(f"{name}: cannot read the image file ({e.strerror or e})") from None
    return name or "image", bytes(source)


def _open_header(data: bytes, max_pixels: int, name: str):
    """Pillow's lazily opened image of `data` (only its header read), checked for format
    and pixel count. Call under `_PIL_LOCK` with Pillow's own bomb check off."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image Pillow can read (expected PNG, JPEG, "
                         "WebP or GIF)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ImageError(f"{name}: corrupt or truncated image ({e})") from None
    if img.format not in FORMATS:
        raise ImageError(f"{name}: unsupported image format {img.format} (expected PNG, "
                         "JPEG, WebP or GIF)")
    w, h = img.size
    if w * h > max_pixels:
        raise ImageError(f"{name}: {w}x{h} = {w * h} pixels is over the limit of "
                         f"{max_pixels} (refused unread as a possible decompression bomb)")
    if w <= 0 or h <= 0:
        raise ImageError(f"{name}: image size {w}x{h} is empty")
    return img


def image_size(source: Union[str, Path, bytes], max_pixels: int = MAX_PIXELS,
               name: str = None) -> Tuple[int, int]:
    """(width, height) in pixels of an encoded image from its header alone: no pixel is
    decoded (Pillow's `Image.open` reads the header; `load` is never called), so a
    decompression bomb costs microseconds here. Raises ImageError as `open_image` (an
    unreadable file, another format, over `max_pixels`), naming `name`."""
    from PIL import Image

    name, data = _read(source, name)
    with _PIL_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            return _open_header(data, max_pixels, name).size
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def open_image(source: Union[str, Path, bytes], max_pixels: int = MAX_PIXELS, name: str = None):
    """Decode `source` (a path or the encoded bytes) with Pillow: its first frame, loaded.

    Raises:
        ImageError: a missing or unreadable file, a format other than PNG / JPEG / WebP /
            GIF, a corrupt file, or more than `max_pixels` pixels (checked from the header,
            before decoding: a possible decompression bomb). Names `name` (default: the
            path, or "image").
    """
    from PIL import Image

    name, data = _read(source, name)
    # Pillow's own bomb check (MAX_IMAGE_PIXELS, a process-wide setting) would refuse a
    # 20000 x 20000 image; ours replaces it for our decodes, under a lock.
    with _PIL_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            img = _open_header(data, max_pixels, name)
            try:
                img.seek(0)
                img.load()
            except (OSError, ValueError, SyntaxError, EOFError) as e:
                raise ImageError(f"{name}: corrupt or truncated {img.format} image ({e})") from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    return img


def _has_alpha(img) -> bool:
    return "A" in img.getbands() or "transparency" in img.info


def _chessboard(h: int, w: int, bg: dict) -> np.ndarray:
    square = bg.get("chessboard_square_size", 8)
    white = bg.get("chessboard_white_value", 255)
    grey = bg.get("chessboard_gray_value", 180)
    grey_parity = 1 if bg.get("chessboard_square_on_top_left", True) else 0
    parity = (np.arange(h)[:, None] // square + np.arange(w)[None, :] // square) % 2
    board = np.where(parity == grey_parity, grey, white).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


def _background(h: int, w: int, bg: dict) -> np.ndarray:
    pattern = bg.get("pattern", "black")
    if pattern == "chessboard":
        return _chessboard(h, w, bg)
    fill = {"white": 255, "black": 0, "gray": 128}.get(pattern)
    if fill is None:
        raise ImageError(f"transparent_bg_config.pattern {pattern!r}: expected chessboard, "
                         "white, black or gray")
    return np.full((h, w, 3), fill, np.uint8)


def _to_rgb(img, bg: dict) -> np.ndarray:
    """uint8 [h, w, 3]: alpha composited onto `bg` (float32, truncated) or plain RGB."""
    if img.mode == "RGB":
        return np.asarray(img)
    if not bg or not _has_alpha(img):
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA"))
    a = rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0)
    back = _background(rgba.shape[0], rgba.shape[1], bg)
    out = a * rgba[:, :, :3] + (np.float32(1.0) - a) * back
    return out.astype(np.uint8)


def preprocess(img, cfg: MediaProcArgs = MediaProcArgs(), source: str = "image") -> ProcessedImage:
    """A decoded Pillow image -> `ProcessedImage` (module docstring, steps 1-5)."""
    from PIL import Image

    width, height = img.size
    new_w, new_h, pad_w, pad_h = resize_plan(width, height, cfg)
    if img.mode not in ("RGB", "RGBA", "L", "LA", "P"):  # CMYK, I;16, 1, ...
        img = img.convert("RGBA" if _has_alpha(img) else "RGB")
    if img.mode == "P":
        img = img.convert("RGBA")
    bg = cfg.transparent_bg_config
    if cfg.transparent_bg_fill_stage == "before_resize":
        img = Image.fromarray(_to_rgb(img, bg))
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    rgb = _to_rgb(img, bg)
    if pad_w or pad_h:
        rgb = np.pad(rgb, ((0, pad_h), (0, pad_w), (0, 0)))
    x = (rgb.astype(np.float64) / 255.0 - np.array(cfg.image_mean)) / np.array(cfg.image_std)
    x = x.astype(np.float32)
    p = cfg.patch_size
    gh, gw = x.shape[0] // p, x.shape[1] // p
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    kh, kw = cfg.merge_kernel_size
    return ProcessedImage(np.ascontiguousarray(patches), (gh, gw), width, height,
                          (gh // kh) * (gw // kw), source)


def load_and_preprocess(source: Union[str, Path, bytes], cfg: MediaProcArgs = MediaProcArgs(),
                        max_pixels: int = MAX_PIXELS, name: str = None) -> ProcessedImage:
    """`open_image` then `preprocess`; the result's `digest` is the SHA-256 of the encoded
    bytes. Raises ImageError as `open_image`."""
    import hashlib

    name, data = _read(source, name)
    out = preprocess(open_image(data, max_pixels, name), cfg, name or "image")
    out.digest = hashlib.sha256(data).hexdigest()
    return out

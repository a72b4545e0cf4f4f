"""Images in API requests: find the image parts of a request's messages (OpenAI
`image_url`, Anthropic `image` blocks, the Responses API's `input_image`), check them
against the server's limits, decode them to bytes (a data URL / base64; an `http(s)` URL
only with `--allow-image-urls`, fetched by httpx with a size limit and a timeout),
preprocess them (`generation.images.Vision.load_image`) and put the result in the part,
so the K3 chat encoder renders its media block.

Everything here runs before a job is admitted: a bad image is a 400 for its own request,
naming the image (`messages[i].content[j]`) and why, and never reaches the engine. The
tower itself runs on the engine's thread (`server.engine`), so MLX stays on one thread.

A job's prompt-cache key (`cache_key`) is its token ids with each `<|media_pad|>`
replaced by (pad id, image digest): the pads of two different images are the same
tokens, so a cache keyed on the ids alone would hand image A's state to a request with
image B.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kimi_mlx.generation.request import InputError
from kimi_mlx.server.common import APIError

__all__ = ["ImageSettings", "ImageRef", "resolve_images", "decode_data_url", "fetch_url",
           "cache_key", "setter", "openai_refs", "request_images", "job_images", "allow_urls",
           "image_settings", "openai_ref", "anthropic_ref", "responses_ref", "lean_messages",
           "stored_refs", "has_image_parts", "prepare", "DEFAULT_MAX_IMAGES", "DEFAULT_MAX_PIXELS",
           "URL_MAX_BYTES", "URL_TIMEOUT_S"]

DEFAULT_MAX_IMAGES = 32
# pixels a request's images may have in all (--max-image-pixels): one 20000 x 20000
# image, the per-image limit the preprocessor has always had
DEFAULT_MAX_PIXELS = 20000 * 20000
# an image fetched by URL (--allow-image-urls): at most this many bytes, this many seconds
URL_MAX_BYTES = 20 << 20
URL_TIMEOUT_S = 10.0
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


@dataclass
class ImageSettings:
    """The server's image policy. vision: `generation.images.Vision` of the checkpoint,
    or None when it has no vision weights; allow_urls: fetch `http(s)` image URLs
    (`--allow-image-urls`); max_images: images per request (`--max-images`);
    max_pixels: pixels decoded per request, summed over its images, and so per image too
    (`--max-image-pixels`); pad_id: the tokenizer's `<|media_pad|>` id (None without
    vision)."""

    vision: Any = None
    allow_urls: bool = False
    max_images: int = DEFAULT_MAX_IMAGES
    pad_id: Optional[int] = None
    max_pixels: int = DEFAULT_MAX_PIXELS


@dataclass
class ImageRef:
    """One image part of a request before decoding. where: its place for messages
    (`messages[1].content[0]`); kind: "data" (bytes in `data`) or "url" (`url`);
    put: stores the resolved part (the encoder's {"type": "image", "media": ...})."""

    where: str
    put: Callable[[dict], None]
    data: Optional[bytes] = None
    url: Optional[str] = None


def _field(where: str) -> str:
    """The request field a place is in: "messages" (chat, messages APIs) or "input"."""
    return where.split("[", 1)[0].split(".", 1)[0] or "messages"


def _bad(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", param=_field(where))


def decode_data_url(url: str, where: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; APIError 400 naming `where` for
    another scheme, a non-image or unsupported media type, or invalid base64."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise _bad(where, "the image URL is not a data URL")
    meta = head[5:].split(";")
    media = meta[0].strip().lower()
    if media not in MEDIA_TYPES:
        raise _bad(where, f"image media type {media or '(none)'!r} is not supported; send "
                   f"one of {', '.join(MEDIA_TYPES)}")
    if "base64" not in (m.strip().lower() for m in meta[1:]):
        raise _bad(where, "the image data URL must be base64-encoded (data:image/png;base64,...)")
    return _b64(payload, where)


def _b64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(where, f"the image data is not valid base64 ({e})") from None


def fetch_url(url: str, where: str, max_bytes: int = URL_MAX_BYTES,
              timeout: float = URL_TIMEOUT_S) -> bytes:
    """GET an image URL with httpx: at most `max_bytes` read (a longer body is refused,
    not truncated), `timeout` seconds per phase, redirects followed (at most 5).
    APIError 400 naming `where` for a failed, non-200 or oversized fetch."""
    import httpx

    try:
        with httpx.Client(timeout=timeout, follow_redirects=True, max_redirects=5) as client:
            with client.stream("GET", url, headers={"Accept": ", ".join(MEDIA_TYPES)}) as r:
                if r.status_code != 200:
                    raise _bad(where, f"fetching the image URL gave HTTP {r.status_code}")
                size = r.headers.get("content-length")
                if size and size.isdigit() and int(size) > max_bytes:
                    raise _bad(where, f"the image at the URL is {size} bytes, over the "
                               f"limit of {max_bytes} bytes")
                chunks, n = [], 0
                for chunk in r.iter_bytes():
                    n += len(chunk)
                    if n > max_bytes:
                        raise _bad(where, f"the image at the URL is over the limit of "
                                   f"{max_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.HTTPError as e:
        raise _bad(where, f"fetching the image URL failed: {type(e).__name__}: {e}") from None


def _url_ref(url: Any, where: str, put, allow_urls: bool) -> ImageRef:
    if not isinstance(url, str) or not url:
        raise _bad(where, "the image URL must be a non-empty string")
    if url.startswith("data:"):
        return ImageRef(where, put, data=decode_data_url(url, where))
    if url.lower().startswith(("http://", "https://")):
        if not allow_urls:
            raise _bad(where, "image URLs (http/https) are not fetched by this server; send "
                       "the image as a data URL (data:image/png;base64,...), or start the "
                       "server with --allow-image-urls")
        return ImageRef(where, put, url=url)
    raise _bad(where, f"the image URL scheme of {url[:16]!r}... is not supported; send a "
               "data URL (data:image/png;base64,...)")


def openai_ref(part: dict, where: str, put, allow_urls: bool) -> ImageRef:
    """An OpenAI `image_url` part ({"type": "image_url", "image_url": {"url": ...}} or
    the url as a string) -> ImageRef; APIError 400 naming `where`."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise _bad(where, "an image_url part needs image_url.url, a data URL "
                   "(data:image/png;base64,...)")
    return _url_ref(url, where, put, allow_urls)


def responses_ref(part: dict, where: str, put, allow_urls: bool) -> ImageRef:
    """A Responses API `input_image` part ({"type": "input_image", "image_url": ...})."""
    if part.get("file_id") and not part.get("image_url"):
        raise _bad(where, "input_image with a file_id is not supported; send image_url as a "
                   "data URL")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise _bad(where, "an input_image part needs image_url, a data URL "
                   "(data:image/png;base64,...)")
    return _url_ref(url, where, put, allow_urls)


def anthropic_ref(block: dict, where: str, put, allow_urls: bool) -> ImageRef:
    """An Anthropic `image` block ({"type": "image", "source": {"type": "base64",
    "media_type", "data"}} or source type "url") -> ImageRef; APIError 400 naming `where`."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(where, "an image block needs a 'source' object")
    kind = src.get("type")
    if kind == "base64":
        media = src.get("media_type")
        if media not in MEDIA_TYPES:
            raise _bad(where, f"image media_type {media!r} is not supported; send one of "
                       f"{', '.join(MEDIA_TYPES)}")
        data = src.get("data")
        if not isinstance(data, str) or not data:
            raise _bad(where, "an image source's 'data' must be a non-empty base64 string")
        return ImageRef(where, put, data=_b64(data, where))
    if kind == "url":
        url = src.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise _bad(where, "an image source of type 'url' needs an http(s) 'url'")
        return _url_ref(url, where, put, allow_urls)
    raise _bad(where, f"image source type {kind!r} is not supported; use 'base64'"
               + (" or 'url'" if allow_urls else ""))


def _input_error(ref: ImageRef, e: InputError) -> APIError:
    msg = str(e)
    return APIError(400, msg if msg.startswith(ref.where) else f"{ref.where}: {msg}",
                    param=_field(ref.where))


def resolve_images(settings: ImageSettings, refs: Sequence[ImageRef], context: int) -> List[Any]:
    """Size, check, then decode and preprocess a request's images (in prompt order) and
    store each resolved part through its `put`. Returns the `ProcessedImage`s.

    Every check runs on the images' headers before any pixel is decoded (Pillow's
    `Image.open` reads only the header): the count, each image's format and size, the
    pixels of all of them together, and their tokens (`vision.preprocess.token_count`
    of the header's width x height) against the context. So a decompression bomb costs
    a header read, not a decode.

    APIError 400: images with a checkpoint that has no vision weights; more than
    `settings.max_images` images; a corrupt or unsupported image, or one whose header
    says more than `settings.max_pixels` pixels (naming it); images with more than
    `settings.max_pixels` pixels in all (--max-image-pixels); image tokens that alone
    reach `context` (naming the image that reaches it, its size, the count and the
    limit)."""
    if not refs:
        return []
    if settings.vision is None:
        raise _bad(refs[0].where, "this model has no vision weights (no vision_config or no "
                   "vision_tower.* / mm_projector.* tensors in its checkpoint), so it cannot "
                   "take images")
    if len(refs) > settings.max_images:
        raise APIError(400, f"the request has {len(refs)} images; this server takes at most "
                       f"{settings.max_images} per request (--max-images)",
                       param=_field(refs[0].where))
    vision = settings.vision
    datas, sizes = [], []
    pixels = tokens = 0
    for ref in refs:  # headers only: nothing is decoded until every check has passed
        data = ref.data if ref.url is None else fetch_url(ref.url, ref.where)
        try:
            w, h = vision.image_size(data, name=ref.where)
        except InputError as e:
            raise _input_error(ref, e) from None
        datas.append(data)
        sizes.append((w, h))
        pixels += w * h
        if pixels > settings.max_pixels:
            raise _bad(ref.where, f"the request's images up to this one ({w}x{h}) have "
                       f"{pixels} pixels; this server decodes at most {settings.max_pixels} "
                       "pixels per request (--max-image-pixels)")
    counts = [vision.token_count(w, h) for w, h in sizes]
    if sum(counts) >= context:
        for ref, (w, h), n in zip(refs, sizes, counts):  # name the image that reaches it
            tokens += n
            if tokens >= context:
                raise _bad(ref.where, f"the image ({w}x{h}) takes {n} tokens; the request's "
                           f"{len(refs)} image(s) take {sum(counts)} tokens; this model's "
                           f"context is {context} tokens (with the text, the prompt must "
                           "stay below it)")
    out = []
    for ref, data, (w, h) in zip(refs, datas, sizes):
        try:
            im = vision.load_image(data, name=ref.where)
        except InputError as e:
            raise _input_error(ref, e) from None
        if (im.width, im.height) != (w, h):  # a header that lied about the frame's size
            raise _bad(ref.where, f"the image decodes to {im.width}x{im.height}, not the "
                       f"{w}x{h} its header states")
        out.append(im)
    for ref, im, data in zip(refs, out, datas):
        # the encoded bytes stay with the part: a stored conversation (Responses API)
        # keeps them instead of the preprocessed patches (`lean_messages`)
        ref.put({"type": "image", "media": im, "data": data})
    return out


def cache_key(ids: Sequence[int], images: Sequence[Any], pad_id: Optional[int]) -> Optional[Tuple]:
    """The prompt-cache key of a prompt with images: `ids` with the k-th `<|media_pad|>`
    replaced by (pad_id, digest of the image it belongs to), so two prompts share a key
    prefix only up to the first image that differs. None without images (the ids are
    the key). ValueError when the pads do not add up to the images' token counts."""
    if not images:
        return None
    owners: List[str] = []
    for im in images:
        owners += [im.digest] * im.num_tokens
    key, k = [], 0
    for t in ids:
        if t == pad_id:
            if k >= len(owners):
                break
            key.append((t, owners[k]))
            k += 1
        else:
            key.append(t)
    if k != len(owners) or len(key) != len(ids):
        raise ValueError(f"the prompt has {sum(1 for t in ids if t == pad_id)} <|media_pad|> "
                         f"tokens but its images take {len(owners)}")
    return tuple(key)


def image_settings(model_dir, tok, config: Optional[Dict[str, Any]] = None,
                   allow_urls: bool = False, max_images: int = DEFAULT_MAX_IMAGES,
                   metrics=None, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageSettings:
    """The image policy of a loaded checkpoint: its `Vision` (the tower is loaded on the
    first image; its rows cached by image digest) when it has vision weights, else none.
    `metrics` (the server's `Metrics`): export the tower's run and cache counters.
    `max_pixels`: pixels per request, summed over its images (--max-image-pixels)."""
    from kimi_mlx.checkpoint.loader import has_vision
    from kimi_mlx.generation.images import Vision, media_pad_id

    settings = ImageSettings(allow_urls=allow_urls, max_images=max_images,
                             max_pixels=max_pixels)
    if has_vision(model_dir):
        settings.vision = Vision(model_dir, max_pixels=max_pixels)
        settings.pad_id = media_pad_id(tok, config)
        if metrics is not None:
            metrics.watch_vision(settings.vision)
    return settings


def setter(container: list, index: int):
    """An ImageRef's `put`: stores the resolved part at container[index]."""
    def put(part: dict) -> None:
        container[index] = part
    return put


def openai_refs(messages: Sequence[Dict[str, Any]], allow_urls: bool,
                label: str = "messages") -> List[ImageRef]:
    """The `image_url` parts of chat_format messages (an OpenAI request's, in prompt
    order), each naming `messages[i].content[j]`; their `put` replaces the part."""
    refs = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                refs.append(openai_ref(part, f"{label}[{i}].content[{j}]",
                                       setter(content, j), allow_urls))
    return refs


def request_images(svc, refs: Sequence[ImageRef]) -> List[Any]:
    """`resolve_images` with the service's settings and context, after checking that
    its engine takes images (APIError 400 otherwise, e.g. with a draft model)."""
    if not refs:
        return []
    settings = svc.images or ImageSettings()
    engine = svc.engine
    if settings.vision is not None and engine is not None:  # (count_tokens while loading)
        why = engine.images_unsupported()
        if why:
            raise _bad(refs[0].where, why)
    return resolve_images(settings, refs, svc.context)


def job_images(svc, ids: Sequence[int], images: Sequence[Any]) -> Dict[str, Any]:
    """The Job keyword arguments of a prompt's images: the images and the cache key."""
    if not images:
        return {}
    try:
        key = cache_key(ids, images, svc.images.pad_id)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return {"images": list(images), "key": key}


def allow_urls(svc) -> bool:
    """Whether the service fetches http(s) image URLs (`--allow-image-urls`)."""
    return bool(svc.images is not None and svc.images.allow_urls)


IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def has_image_parts(req) -> bool:
    """Whether a parsed request (pydantic model) holds a part / block whose type is an
    image type anywhere in it (walked without recursion; the body's nesting is bounded
    by `common.MAX_NESTING`)."""
    todo = [req.model_dump()]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("type") in IMAGE_PART_TYPES:
                return True
            todo.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, (dict, list)))
    return False


async def prepare(fn, svc, req):
    """`fn(svc, req)` (an API module's request -> job step): on a worker thread when the
    request has images, whose decoding and resizing (Pillow, up to `MAX_PIXELS` pixels,
    or a fetch) must not hold up the event loop and so the other clients' streams; inline
    otherwise. A request with tools or a response format goes to a thread too: its
    structured-output grammar is compiled there (`server.structured`, ~20-30 ms for 25
    tools on K3.1's vocabulary)."""
    # a continued Responses conversation may hold images from before
    # the cheap tests first: walking a request with a large schema takes seconds
    if not (getattr(req, "previous_response_id", None) or getattr(req, "tools", None)
            or getattr(req, "response_format", None) or getattr(req, "text", None)
            or has_image_parts(req)):
        return fn(svc, req)
    import asyncio

    return await asyncio.to_thread(fn, svc, req)


def lean_messages(messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Copies of chat_format messages whose resolved image parts keep only the encoded
    bytes ({"type": "image", "data": ...}): what a conversation store holds, a few
    hundred KB per image instead of the patches (float32, up to ~150 MB for the largest
    image). `stored_refs` makes them parts of a later request again."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and "media" in p for p in content):
            m = dict(m, content=[{"type": "image", "data": p["data"]}
                                 if isinstance(p, dict) and "media" in p else p for p in content])
        out.append(m)
    return out


def stored_refs(messages: Sequence[Dict[str, Any]], label: str) -> Tuple[List[Dict[str, Any]], List[ImageRef]]:
    """(copies of stored `lean_messages`, ImageRefs of their images in order, named
    `label` image k): the refs resolve the copies' image parts again."""
    out, refs = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = list(content)
            m = dict(m, content=content)
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") == "image" and "data" in p:
                    refs.append(ImageRef(f"{label} image {len(refs)}", setter(content, j),
                                         data=p["data"]))
        out.append(m)
    return out, refs
